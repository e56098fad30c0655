"""The Makefile's targets, run by make in a folder of the test's own (its out/ and data/ are the
test's): what each runs, and in which order. `make -n` where the commands make would run prove the
point; a real make where a command's outcome decides what comes next."""
import os
import shutil
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.skipif(shutil.which('make') is None, reason='no make on this machine')
PY = sys.executable
# make cpu SEEDS=1 and make paper SEEDS=1: their configs, and how each prepares its data with
# TINYSTORIES=stories.txt (the paper's data is the whole TinyStories, whatever TINYSTORIES says)
TARGETS = {'cpu': (['cpu_moe', 'cpu_dense_active', 'cpu_dense_total'],
                   'prepare.py --input stories.txt --tokenizer bytes '
                   '--out_dir data/tinystories_bytes'),
           'paper': (['moe', 'dense_active', 'dense_total'],
                     'prepare.py --out_dir data/tinystories')}


def make(folder, *args, env=None):
    """make in folder, with the Makefile and what it reads (study/study.mk, config/), this
    Python, and setup taken as done (-o setup: no pip installs)."""
    for name in ('Makefile', 'study', 'config'):
        if not os.path.exists(folder / name):
            os.symlink(os.path.join(REPO, name), folder / name)
    # as a make of its own, not make test's sub-make: its flags (-n, -j) and level (a sub-make
    # prints the folders it enters) would change what this one prints
    env = {k: v for k, v in (env or os.environ).items()
           if k not in ('MAKEFLAGS', 'MFLAGS', 'MAKELEVEL')}
    return subprocess.run(['make', '-o', 'setup', f'PYTHON={PY}', *args], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=120)


def commands(out):
    """The commands of a make -n, a line each (continued lines joined, spaces as one)."""
    assert out.returncode == 0, out.stderr
    return [' '.join(line.split()) for line in out.stdout.replace('\\\n', ' ').splitlines()]


def finish(folder, runs):
    """Stand-ins for finished runs: make knows a finished run by its done.json alone."""
    for run in runs:
        os.makedirs(folder / 'out' / run)
        (folder / 'out' / run / 'done.json').write_text('{}')


@pytest.mark.parametrize('target', TARGETS)
@pytest.mark.parametrize('stories', ['', 'stories.txt'])
def test_a_finished_comparison_reprints_without_preparing_the_data(tmp_path, target, stories):
    """All runs done: the report alone, whatever the data's source (the hub, or a file, each of
    which a FORCE data target would prepare again): no prepare.py, so no network."""
    configs, _ = TARGETS[target]
    finish(tmp_path, [f'{config}-s1' for config in configs])
    folders = ' '.join(f'out/{config}-s1/' for config in configs)
    assert commands(make(tmp_path, '-n', target, 'SEEDS=1', f'TINYSTORIES={stories}')) == [
        f'{PY} report.py {folders} --out out/report-{target}']


@pytest.mark.parametrize('target', TARGETS)
def test_a_run_left_to_train_prepares_the_data_first(tmp_path, target):
    """One run remains: prepare.py first (it redoes the data if its source changed), then that
    run trains, then the report."""
    configs, prepare = TARGETS[target]
    finish(tmp_path, [f'{config}-s1' for config in configs[1:]])
    folders = ' '.join(f'out/{config}-s1/' for config in configs)
    assert commands(make(tmp_path, '-n', target, 'SEEDS=1', 'TINYSTORIES=stories.txt')) == [
        f'{PY} {prepare}', f'{PY} train.py config/{configs[0]}.py --seed=1',
        f'{PY} report.py {folders} --out out/report-{target}']


def test_gpu_check_asks_for_a_cuda_gpu_before_it_prepares_the_data(tmp_path):
    """The GPU check's order: torch sees a GPU, then both data sets, then the check."""
    found = commands(make(tmp_path, '-n', 'gpu_check'))
    assert [command.split()[1] for command in found] == ['-c', 'prepare.py', 'prepare.py',
                                                         'gpu_check.py']
    assert 'torch.cuda.is_available()' in found[0]


def test_without_a_cuda_gpu_make_gpu_check_says_so_in_one_line(tmp_path):
    """Before any data (the hub, a minute): the line, and make's own that the step failed."""
    out = make(tmp_path, 'gpu_check', env={**os.environ, 'CUDA_VISIBLE_DEVICES': ''})
    assert out.returncode != 0 and out.stdout == ''
    assert out.stderr.splitlines()[0] == (
        'make gpu_check: torch sees no CUDA GPU; on a CPU, check the logic at toy sizes: python '
        'gpu_check.py --size=toy')
    assert len(out.stderr.splitlines()) == 2 and not os.path.exists(tmp_path / 'data')
