"""
train.py stopped after STEPS steps, as a Ctrl-C would stop it: what it saved by then (latest.pt
every ckpt_interval steps, log.jsonl, best.pt) stays for a later --resume=True. The GPU check
(gpu_check.py) tests resuming with it.

    python tests/train_until.py 100 config/moe.py --max_iters=200 --ckpt_interval=100
    python train.py config/moe.py --max_iters=200 --ckpt_interval=100 --resume=True
"""
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
import train  # noqa: E402
from errors import UserError, one_line_errors  # noqa: E402


def loss_until(steps):
    """train.training_loss, but step `steps` (counting from 0) raises KeyboardInterrupt when it asks
    for its loss: steps 0 to steps - 1 are done and saved as train.py saves them."""
    real_loss, calls = train.training_loss, []

    def loss_or_stop(ce, aux, c):
        if len(calls) == steps * c.grad_accum:
            raise KeyboardInterrupt
        calls.append(1)
        return real_loss(ce, aux, c)
    return loss_or_stop


def main(argv):
    if not argv or not argv[0].isdigit():
        raise UserError('usage: python tests/train_until.py STEPS CONFIG [--key=value ...]')
    steps = int(argv[0])
    train.training_loss = loss_until(steps)
    try:
        train.main(argv[1:])
    except KeyboardInterrupt:
        print(f'train_until.py: stopped after {steps} steps')
        return
    raise UserError(f'the run ended before step {steps}: give STEPS below its max_iters')


if __name__ == '__main__':
    with one_line_errors('train_until.py'):
        main(sys.argv[1:])
