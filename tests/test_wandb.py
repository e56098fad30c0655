"""W&B logging, offline (WANDB_MODE=offline): every log.jsonl record reaches W&B with the same
values at its step, the config is the run's config, a resumed run continues its W&B run, and
without the wandb package wandb_log=True is one line naming the fix."""
import json

import pytest

import runs
import train
from conftest import TINY, config, interrupt_training
from errors import UserError

wandb = pytest.importorskip('wandb')


@pytest.fixture
def recorded(monkeypatch, tmp_path):
    """W&B offline, and every (run id, config, logged payload, step) the training sends to it."""
    monkeypatch.setenv('WANDB_MODE', 'offline')
    monkeypatch.setenv('WANDB_SILENT', 'true')
    monkeypatch.setenv('WANDB_DIR', str(tmp_path))
    calls = {'ids': [], 'configs': [], 'logged': []}
    real_open = runs.open_wandb

    def open_and_record(c):
        run = real_open(c)
        real_log = run.log
        calls['ids'].append(run.id)
        calls['configs'].append(dict(run.config))

        def log(payload, step):
            calls['logged'].append((payload, step))
            real_log(payload, step=step)
        run.log = log
        return run
    monkeypatch.setattr(runs, 'open_wandb', open_and_record)
    return calls


def train_args(prepared, out_dir, *extra):
    return ['config/cpu_moe.py', f'--data_dir={prepared / "data"}', f'--out_dir={out_dir}',
            *TINY, '--ckpt_interval=10', '--wandb_log=True', *extra]


def expected(out_dir):
    """What W&B should have received: each log.jsonl record, flattened, at its iter."""
    records = [json.loads(line) for line in open(out_dir / 'log.jsonl')]
    return [(runs.wandb_record(r, 'val' if 'val_loss' in r else 'train'), r['iter'])
            for r in records]


def test_wandb_gets_every_record_of_log_jsonl_and_the_config(prepared, tmp_path, recorded):
    out_dir = tmp_path / 'run'
    train.main(train_args(prepared, out_dir))
    assert recorded['logged'] == expected(out_dir)
    payload, step = recorded['logged'][-1]  # the last eval: val loss and routing per layer
    assert step == 40 and 'val/val_loss' in payload and 'val/layers/1/busiest_frac' in payload
    assert payload['flops'] == 40 * 8 * 32 * train.flops_per_token(train.configure(
        train_args(prepared, out_dir)))
    assert recorded['configs'][0]['seed'] == 1 and recorded['configs'][0]['ffn'] == 'moe'
    # the offline run is written into the run folder
    run_id = (out_dir / 'wandb_id').read_text().strip()
    assert list((out_dir / 'wandb').glob(f'offline-run-*-{run_id}'))


def test_a_resumed_run_continues_its_wandb_run(prepared, tmp_path, recorded, monkeypatch):
    out_dir = tmp_path / 'resumed'
    interrupt_training(monkeypatch, train_args(prepared, out_dir), at_call=15)
    wandb.finish()  # as the end of the interrupted process would
    train.main(train_args(prepared, out_dir, '--resume=True'))
    first, second = recorded['ids']
    assert first == second == (out_dir / 'wandb_id').read_text().strip()
    # before the interruption eval 0 and iter 10, after it the rest: log.jsonl, line by line
    assert recorded['logged'] == expected(out_dir)


def test_wandb_log_without_wandb_is_one_line_naming_the_fix(monkeypatch):
    real_find_spec = train.importlib.util.find_spec
    monkeypatch.setattr(train.importlib.util, 'find_spec',
                        lambda name: None if name == 'wandb' else real_find_spec(name))
    fix = 'wandb_log=True needs the wandb package: pip install wandb'
    with pytest.raises(UserError, match=fix):
        config(wandb_log=True)
