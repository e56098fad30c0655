"""The CPU study: python -m study.<script> from the top of the repository (README.md)."""
