"""The study's configs (study/config/): each is the CPU recipe's MoE with fields of its own, and
the MoE variants that make study2 trains keep cpu_moe's FFN size."""
import glob
import os
import re

import pytest

import train
from tests.conftest import REPO

CONFIGS = os.path.join(REPO, 'study', 'config')


def study_variants():
    """study.mk's VARIANTS, the MoE variants make study2 trains."""
    text = open(os.path.join(REPO, 'study', 'study.mk')).read().replace('\\\n', ' ')
    found = re.search(r'^VARIANTS \?= (.*)$', text, re.M)
    assert found, 'study.mk has no "VARIANTS ?=" line'
    names = found.group(1).split()
    assert len(names) >= 4, names
    return names


@pytest.mark.parametrize('name', study_variants())
def test_variants_have_cpu_moes_ffn_size_and_params_within_2_percent(name):
    base = train.configure([os.path.join(REPO, 'config', 'cpu_moe.py')])
    c = train.configure([os.path.join(CONFIGS, f'{name}.py')])

    def ffn_widths(c):  # active and total FFN hidden width per layer
        routed = c.top_k * c.moe_hidden, c.n_experts * c.moe_hidden
        return routed[0] + c.shared_hidden, routed[1] + c.shared_hidden
    assert ffn_widths(c) == ffn_widths(base) == (176, 352)
    n, n_base = train.count_params(c), train.count_params(base)
    for key in ('total', 'active'):  # only the wider routers add params
        assert n[key] >= n_base[key] and n[key] / n_base[key] - 1 < 0.02


def test_each_config_builds_on_cpu_moe_or_the_recipe_alone():
    """One import each, of a config a user has: no config of the study reads another."""
    paths = sorted(glob.glob(os.path.join(CONFIGS, '*.py')))
    assert len(paths) >= 10
    allowed = (['from config.cpu_moe import *'], ['from config.cpu_recipe import *'])
    for path in paths:
        with open(path) as f:
            imports = [line.strip() for line in f if line.startswith(('from ', 'import '))]
        assert imports in allowed, path
