"""
nanoGPT's configurator, made strict. Config files (Python, executed in order), then --key=value
overrides (literal_eval, else a plain string), replace the defaults. Unknown keys and wrong types
are errors that name the closest valid key, so a typo never silently falls back to a default.

    c = configure(defaults, ['config/cpu_moe.py', '--seed=2'])  # -> SimpleNamespace
    check(c)  # train.py's rules across keys (ranges, combinations, the device)
    run_dir(c)  # out/cpu_moe-s2: where the run's files go, unless out_dir says
"""
import ast
import difflib
import importlib.util
import os
import types

import torch

from errors import UserError


def configure(defaults, argv):
    """defaults: {key: value} of bool/int/float/str/None (None: a bool that may stay unset)."""
    cfg = dict(defaults)

    def set_key(key, value, where):
        if key not in cfg:
            close = difflib.get_close_matches(key, list(defaults), n=3, cutoff=0.5)
            hint = f'; did you mean {", ".join(close)}?' if close else ''
            raise UserError(f'unknown config key {key!r} in {where}{hint}')
        default = defaults[key]
        if isinstance(default, float) and type(value) is int:
            value = float(value)  # an int where a float is expected is fine
        if default is None:
            ok = value is None or type(value) is bool
        else:
            ok = type(value) is type(default)
        if not ok:
            want = 'True, False or None' if default is None else type(default).__name__
            raise UserError(f'{key} must be {want}, got {value!r} ({type(value).__name__}) '
                            f'in {where}')
        cfg[key] = value

    for i, arg in enumerate(argv):  # before the files: in `--seed 5`, '5' is no config file
        if arg.startswith('--') and '=' not in arg:
            value = argv[i + 1] if i + 1 < len(argv) else 'value'
            raise UserError(f'override {arg!r} must look like --key=value: {arg}={value}')
    files = [a for a in argv if not a.startswith('--')]
    for path in files:
        if not os.path.isfile(path):
            raise UserError(f'config file {path!r} not found (configs live in config/, '
                            'e.g. config/cpu_moe.py)')
        namespace = {}
        try:
            exec(open(path).read(), namespace)
        except Exception as e:  # a config file is user code: report its error as one line
            raise UserError(f'config file {path} failed: {type(e).__name__}: {e}') from None
        for key, value in namespace.items():
            if not key.startswith('_') and not isinstance(value, types.ModuleType):
                set_key(key, value, path)
    for arg in argv:
        if arg.startswith('--'):
            key, _, text = arg[2:].partition('=')
            try:
                value = ast.literal_eval(text)
            except (ValueError, SyntaxError):
                value = text  # --device=cuda is the string 'cuda'
            set_key(key, value, 'the command line')
    c = types.SimpleNamespace(**cfg)
    if 'config_name' in cfg and not c.config_name:  # the last config file names the run
        c.config_name = os.path.splitext(os.path.basename(files[-1]))[0] if files else 'default'
    return c


POSITIVE = ('vocab_size', 'block_size', 'n_layer', 'n_head', 'd_model', 'ffn_multiple_of',
            'n_experts', 'moe_hidden', 'batch_size', 'grad_accum', 'eval_interval', 'eval_tokens',
            'log_interval', 'ckpt_interval')
NOT_NEGATIVE = ('seed', 'data_seed',  # numpy's generator takes seed 0, no negative one
                'bias_rate', 'shared_hidden', 'router_init_std', 'router_lr_mult', 'warmup_iters')


def run_dir(c):
    """out/{config_name}-s{seed}[-d{data_seed}]: seeds never overwrite each other."""
    name = f'{c.config_name}-s{c.seed}'
    if c.data_seed:
        name += f'-d{c.data_seed}'
    return os.path.join('out', name)


def check(c):
    """The rules of train.py's config that no single value's type can say."""
    choices = (('ffn', ('dense', 'moe')), ('match', ('', 'active', 'total')),
               ('dtype', ('auto', 'float32', 'bfloat16', 'float16')))
    for key, allowed in choices:
        if getattr(c, key) not in allowed:
            raise UserError(f'{key} must be one of {allowed}, got {getattr(c, key)!r}')
    for key in POSITIVE:
        if getattr(c, key) < 1:
            raise UserError(f'{key} must be positive, got {getattr(c, key)}')
    for key in NOT_NEGATIVE:
        if getattr(c, key) < 0:
            raise UserError(f'{key} must be >= 0, got {getattr(c, key)}')
    check_device(c.device)
    if c.wandb_log and importlib.util.find_spec('wandb') is None:
        raise UserError('wandb_log=True needs the wandb package: pip install wandb '
                        '(or leave wandb_log off)')
    world = int(os.environ.get('WORLD_SIZE', 1))  # torchrun's processes
    if c.grad_accum % world:
        raise UserError(f'grad_accum ({c.grad_accum}) must be a multiple of the number of '
                        f'processes ({world}): each process takes its share of the micro-batches '
                        'of every step')
    if c.max_iters < 0 or not (c.max_iters or c.max_tokens > 0):
        raise UserError('nothing to train: set max_tokens or max_iters > 0')
    # a resumed run then starts on a log line, and its log lines match an uninterrupted run's
    if c.ckpt_interval % c.log_interval:
        raise UserError(f'ckpt_interval ({c.ckpt_interval}) must be a multiple of log_interval '
                        f'({c.log_interval})')
    if c.match and (c.ffn != 'dense' or c.ffn_hidden):
        raise UserError("match = 'active' | 'total' sizes a dense FFN: use it with ffn = 'dense' "
                        'and without ffn_hidden')
    if c.d_model % c.n_head or (c.d_model // c.n_head) % 2:
        raise UserError(f'd_model ({c.d_model}) must split into n_head ({c.n_head}) heads of even '
                        'size (RoPE rotates pairs)')
    if c.ffn == 'dense' and not c.match and c.ffn_hidden <= 0:
        raise UserError("a dense config needs ffn_hidden > 0 or match = 'active' | 'total'")
    if c.ffn != 'moe' and c.bias_rate:  # (the other MoE keys size a matched dense model)
        raise UserError('bias_rate balances MoE routers: use it with ffn = moe')
    if not 1 <= c.top_k <= c.n_experts:
        raise UserError(f'top_k must be between 1 and n_experts ({c.n_experts}), got {c.top_k}')


def check_device(device):
    if device == 'auto':
        return
    try:
        torch.device(device)
    except RuntimeError:
        raise UserError("device must be 'auto', 'cpu', 'cuda' or e.g. 'cuda:1', "
                        f'got {device!r}') from None
    if device.startswith('cuda') and not torch.cuda.is_available():
        raise UserError(f'device={device!r} but torch sees no CUDA GPU; use --device=cpu (or auto)')
    if device == 'mps' and not torch.backends.mps.is_available():
        raise UserError("device='mps' but torch sees no Apple GPU; use --device=cpu (or auto)")
