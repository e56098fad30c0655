"""
The machine a result depends on: its name (the GPU's, or the CPU's with its vector ISA and
threads) and, for the MFU, a GPU's tensor-core peak. runs.py, bench.py and gpu_check.py use it.
"""
import os
import platform

import torch

# Dense tensor-core peaks in FLOP/s for the MFU (data sheets quote twice as much, with sparsity),
# bf16 (fp16 on the V100 and T4: no bf16), by torch.cuda.get_device_name's exact name: by a part
# of it, an A10G would get the A10's peak and an H100 PCIe the SXM's
PEAK_FLOPS = {
    'NVIDIA A10': 125e12,  # A10 data sheet: BF16 125 TFLOPS
    # NVIDIA publishes no data sheet for AWS's A10G; 70 TFLOPS BF16 is the figure AWS users quote
    'NVIDIA A10G': 70e12,
    # A100 data sheet: BF16 312 TFLOPS, every form factor and memory size
    'NVIDIA A100-SXM4-40GB': 312e12, 'NVIDIA A100-SXM4-80GB': 312e12,
    'NVIDIA A100-PCIE-40GB': 312e12, 'NVIDIA A100 80GB PCIe': 312e12,
    # H100 data sheet: BF16 1,979 / 1,513 / 1,671 TFLOPS with sparsity for SXM / PCIe / NVL
    'NVIDIA H100 80GB HBM3': 989e12, 'NVIDIA H100 PCIe': 756e12, 'NVIDIA H100 NVL': 835e12,
    # H200 data sheet: BF16 1,979 / 1,671 TFLOPS with sparsity for SXM / NVL
    'NVIDIA H200': 989e12, 'NVIDIA H200 NVL': 835e12,
    'NVIDIA L4': 121e12,  # L4 data sheet: BF16 242 TFLOPS with sparsity
    'NVIDIA L40': 181e12,  # L40 data sheet: BF16 181.05 TFLOPS
    'NVIDIA L40S': 362e12,  # L40S data sheet: BF16 362.05 TFLOPS
    # V100 data sheet: tensor (fp16) 125 TFLOPS SXM2, 112 PCIe
    'Tesla V100-SXM2-16GB': 125e12, 'Tesla V100-SXM2-32GB': 125e12,
    'Tesla V100-PCIE-16GB': 112e12, 'Tesla V100-PCIE-32GB': 112e12,
    'Tesla T4': 65e12,  # T4 data sheet: mixed precision (fp16) 65 TFLOPS
}


def peak_flops(device):
    """The GPU's peak FLOP/s, for the MFU, or None (a CPU, MPS, a GPU not in PEAK_FLOPS)."""
    return PEAK_FLOPS.get(torch.cuda.get_device_name(device)) if device.type == 'cuda' else None


def hardware_name(device):
    """The GPU's name, or the CPU's (cpu_name), for results that depend on the machine."""
    return torch.cuda.get_device_name(device) if device.type == 'cuda' else cpu_name()


def cpu_name():
    """CPU model, vector ISA, torch threads: the rounding of a bit-for-bit rerun depends on all."""
    info = open('/proc/cpuinfo').read() if os.path.exists('/proc/cpuinfo') else ''
    models = [line.split(':', 1)[1].strip() for line in info.splitlines()
              if line.startswith('model name')]
    model = models[0] if models else platform.machine()
    isa, threads = torch.backends.cpu.get_cpu_capability(), torch.get_num_threads()
    return f'{model} ({isa}), {threads} threads'
