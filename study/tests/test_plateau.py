"""study/plateau.py and study/seed_noise.py: what the routers do on the early plateau, and
where the seed noise comes from."""
import json
import random
import statistics

import pytest

from errors import UserError
from study import plateau, seed_noise
from tests.conftest import TINY, run
from tests.test_report import write_jsonl


def test_plateau_table_shows_the_routers_steps_and_each_runs_exit(tmp_path, capsys):
    for name, ces in (('moe', [4.6, 3.0, 2.9, 2.4]), ('dense', [4.6, 2.4, 2.0, 1.9])):
        (tmp_path / name).mkdir()
        lines = []
        for i, ce in enumerate(ces):
            line = {'iter': 25 * (i + 1), 'ce': ce}
            if name == 'moe':
                line.update(busiest_frac=0.5 - 0.05 * i, router_entropy=1.38, log_z=0.2 * i)
            lines.append(line)
        lines.append({'iter': 100, 'val_loss': 2.3, 'best_val': 2.3})
        write_jsonl(tmp_path / name / 'log.jsonl', lines)
    plateau.main([str(tmp_path / 'moe'), str(tmp_path / 'dense'), '--until', '75',
                  '--out', str(tmp_path / 'p.md')])
    rows = (tmp_path / 'p.md').read_text().splitlines()
    assert rows[0] == '| run | exit | value | 25 | 50 | 75 |'
    assert rows[2:] == ['| moe | 100 | ce | 4.600 | 3.000 | 2.900 |',
                        '| moe | 100 | busiest_frac | 0.500 | 0.450 | 0.400 |',
                        '| moe | 100 | router_entropy | 1.380 | 1.380 | 1.380 |',
                        '| moe | 100 | log_z | 0.000 | 0.200 | 0.400 |',
                        '| dense | 50 | ce | 4.600 | 2.400 | 2.000 |']
    assert capsys.readouterr().out.strip() == '\n'.join(rows)


def test_plateau_shows_a_busiest_frac_just_below_040_as_such(tmp_path):
    """Three decimals: 0.399 (below the 0.40 the README reads off the runs) is not shown as
    0.40."""
    (tmp_path / 'moe').mkdir()
    write_jsonl(tmp_path / 'moe' / 'log.jsonl', [{'iter': 150, 'ce': 2.826, 'busiest_frac': 0.399}])
    name, lines, exit_step = plateau.read(str(tmp_path / 'moe'), 250)
    assert '| 0.399 |' in plateau.table([(name, lines, exit_step)])


def test_plateau_unreadable_log_is_one_clear_error(tmp_path):
    with pytest.raises(UserError, match='cannot read .*log.jsonl'):
        plateau.main([str(tmp_path / 'nowhere')])


def test_seed_noise_window_losses_average_to_the_logged_val_loss(prepared):
    """study/seed_noise.py's validation-set standard error rests on per-window losses of best.pt:
    their mean is the best val_loss train.py logged, and they differ from window to window."""
    out_dir = prepared / 'cpu_moe'
    if not (out_dir / 'done.json').exists():
        assert run('train.py', 'config/cpu_moe.py', f'--data_dir={prepared / "data"}',
                   f'--out_dir={out_dir}', *TINY).returncode == 0
    losses = seed_noise.window_losses(str(out_dir))
    logged = json.load(open(out_dir / 'done.json'))['best_val']
    assert losses.mean().item() == pytest.approx(logged, abs=1e-5) and losses.std() > 0

    # its table: each group's runs, and the active gap as dense_active - moe, run by run
    rng = random.Random(0)
    best = {(cfg, i, d): 1 + rng.random()
            for cfg in seed_noise.CONFIGS for i in range(1, 6) for d in range(1, 6)}
    rows = seed_noise.noise_table(best)
    init = rows['init varies (data order of seed 1)']
    assert init['cpu_moe'] == pytest.approx(
        statistics.stdev(best[('cpu_moe', i, 1)] for i in (1, 2, 3)))
    data_gaps = [best[('cpu_dense_active', 1, d)] - best[('cpu_moe', 1, d)] for d in (1, 2, 3)]
    data = rows['data order varies (init of seed 1)']
    assert data['active_gap'] == pytest.approx(statistics.stdev(data_gaps))
    assert data['active_gap_mean'] == pytest.approx(statistics.mean(data_gaps))
    assert rows['both vary (seeds 1-5)']['runs'] == 5

    # leaving the plateau: the first logged step with training CE below the threshold,
    # beside the best val
    ces = [json.loads(line) for line in open(out_dir / 'log.jsonl') if '"ce"' in line]
    threshold = (ces[0]['ce'] + ces[1]['ce']) / 2  # the run learns: the second log line is below it
    assert ces[1]['ce'] < threshold
    assert ((ces[1]['iter'], logged)
            in seed_noise.plateau_escapes(str(prepared), threshold)['cpu_moe'])
    # never below 0
    assert (None, logged) in seed_noise.plateau_escapes(str(prepared), 0.0)['cpu_moe']
