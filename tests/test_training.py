"""What a training step adds up: micro-batches against one batch, the aux losses per micro-batch,
the evaluation's statistics against its batch size, and data of another vocabulary refused."""
import json
from contextlib import nullcontext

import pytest
import torch

import train
from conftest import TINY, config, run


def test_grad_accumulation_equals_one_big_batch(prepared):
    # dense: CE is a per-token mean, so two half-batches average to the full one exactly. (An MoE's
    # load-balancing loss is a product of batch statistics and is, as usual, taken per micro-batch.)
    logs = []
    # the same 8 windows per step, in one or two micro-batches
    for batch, accum in ((8, 1), (4, 2)):
        out_dir = prepared / f'accum{accum}'
        out = run('train.py', 'config/cpu_dense_active.py', f'--data_dir={prepared / "data"}',
                  f'--out_dir={out_dir}', *TINY, '--max_iters=4', '--eval_interval=4',
                  '--log_interval=1', f'--batch_size={batch}', f'--grad_accum={accum}')
        assert out.returncode == 0, out.stderr
        logs.append([json.loads(line) for line in open(out_dir / 'log.jsonl')])
    for one, two in zip(*logs):
        assert one.keys() == two.keys()
        for key in ('loss', 'ce', 'val_loss'):
            if key in one:
                assert one[key] == pytest.approx(two[key], rel=1e-4)


def test_moe_grad_accumulation_takes_aux_losses_per_micro_batch_and_logs_their_mean(prepared):
    """grad_accum=2 on the MoE: step 0's logged loss, ce, lb and z are the means over its two
    micro-batches, each with its own load-balancing loss (a batch statistic), computed here from the
    same init and windows."""
    out_dir = prepared / 'moe_accum'
    args = [f'--data_dir={prepared / "data"}', *TINY, '--max_iters=2', '--eval_interval=2',
            '--log_interval=1', '--batch_size=4', '--grad_accum=2']
    out = run('train.py', 'config/cpu_moe.py', f'--out_dir={out_dir}', *args)
    assert out.returncode == 0, out.stderr
    logged = next(json.loads(line) for line in open(out_dir / 'log.jsonl')
                  if json.loads(line)['iter'] == 1)
    c = train.configure(['config/cpu_moe.py', f'--out_dir={out_dir}', *args])
    torch.manual_seed(c.seed)
    model = train.Transformer(c)
    x, y = train.get_batch(c, 0, torch.device('cpu'))
    micro = []
    for rows in (slice(0, 4), slice(4, 8)):
        _, ce, aux = model(x[rows], y[rows])
        micro.append([train.training_loss(ce, aux, c).item(), ce.item(), aux['lb'].item(),
                      aux['z'].item()])
    for i, key in enumerate(('loss', 'ce', 'lb', 'z')):
        assert logged[key] == pytest.approx((micro[0][i] + micro[1][i]) / 2, rel=1e-5), key
    _, _, whole = model(x, y)  # the load-balancing loss of all 8 windows at once is another number
    assert abs(whole['lb'].item() - logged['lb']) > 1e-6


def test_a_steps_windows_go_to_the_device_the_model_is_on(prepared):
    """Not the CPU alone: an MPS model fed CPU windows fails at its first step. torch's 'meta'
    device stands in for one here; a step's windows are the same on every device."""
    c = config(data_dir=str(prepared / 'data'), vocab_size=257)
    x, y = train.get_batch(c, 3, torch.device('meta'))
    cpu_x, cpu_y = train.get_batch(c, 3, torch.device('cpu'))
    assert x.device.type == y.device.type == 'meta' and cpu_x.device.type == 'cpu'
    assert x.shape == cpu_x.shape == (c.batch_size * c.grad_accum, c.block_size)


def test_data_of_another_vocabulary_is_refused(prepared):
    out = run('train.py', 'config/moe.py', f'--data_dir={prepared / "data"}',
              f'--out_dir={prepared / "wrong_vocab"}')
    assert out.returncode != 0 and 'vocab_size 257' in out.stderr and 'Traceback' not in out.stderr
    assert not (prepared / 'wrong_vocab').exists()


def test_eval_routing_statistics_do_not_depend_on_the_eval_batch_size(prepared):
    torch.manual_seed(0)
    # 10 windows: batches 3,3,3,1 vs 10
    c = config(data_dir=str(prepared / 'data'), eval_tokens=16 * 10)
    model = train.Transformer(c)
    _, windows = train.load_data(c)
    cpu = torch.device('cpu')
    loss_a, a = train.evaluate(model, windows, config(batch_size=3), cpu, nullcontext())
    loss_b, b = train.evaluate(model, windows, config(batch_size=10), cpu, nullcontext())
    assert loss_a == pytest.approx(loss_b, rel=1e-5)
    for key in ('load', 'busiest_frac', 'usage_var', 'router_entropy', 'log_z'):
        assert a[key] == pytest.approx(b[key], rel=1e-5)
    # and they are the statistics of all windows at once: the load counts every token's
    # top_k choices
    _, _, aux = model(windows[:, :-1], windows[:, 1:])
    assert a['load'] == pytest.approx(train.routing_record(aux['routing'])['load'], rel=1e-5)
