"""
The one error path for mistakes a user can fix. Every script imports it; it needs no torch.

    with one_line_errors('train.py'):
        main(argv)   # raise UserError('... : the fix') -> one line on stderr, exit status 1
"""
import contextlib
import sys


class UserError(Exception):
    """Something the user can fix: a missing file, a bad setting, a run folder already in use.
    Its message names the fix; the script's entry point prints it."""


@contextlib.contextmanager
def one_line_errors(script):
    """Around a script's main: a UserError becomes `script: error: message` on stderr and exit
    status 1 (raised before anything is overwritten). Any other exception is a bug and keeps its
    traceback."""
    try:
        yield
    except UserError as e:
        print(f'{script}: error: {e}', file=sys.stderr)
        sys.exit(1)
