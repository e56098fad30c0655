"""The MoE variants in the training loop: the selection bias's update after each step and the
routers' own learning rate and weight decay, each against the same step recomputed from the same
init and batch; and runs saved before these keys existed."""
import torch

import runs
import sample
import train
from conftest import TINY, config, run


def one_step(prepared, out_dir, *extra):
    """A run of one optimizer step; -> (its config, the weights after the step)."""
    args = ['config/cpu_moe.py', f'--data_dir={prepared / "data"}', f'--out_dir={out_dir}', *TINY,
            '--max_iters=1', *extra]
    out = run('train.py', *args)
    assert out.returncode == 0, out.stderr
    return train.configure(args), torch.load(out_dir / 'latest.pt', weights_only=True)['model']


def initial(c):
    torch.manual_seed(c.seed)
    return train.Transformer(c)


def test_the_bias_moves_after_a_step_towards_equal_load(prepared, tmp_path):
    c, after = one_step(prepared, tmp_path / 'bias', '--bias_rate=0.01', '--aux_loss_coef=0.0')
    x, y = train.get_batch(c, 0, torch.device('cpu'))
    _, _, aux = initial(c)(x, y)  # the step's routing, before its update
    for i, row in enumerate(aux['routing']):
        load, _, _ = train.unpack_routing(row)
        expected = torch.where(load > 0.25, -0.01, 0.01)  # overloaded experts down, the others up
        assert (load != 0.25).all() and (expected < 0).any()
        torch.testing.assert_close(after[f'blocks.{i}.ffn.bias'], expected)


def test_the_routers_learning_rate_and_decay_apply_to_the_routers_alone(prepared, tmp_path):
    c, full = one_step(prepared, tmp_path / 'full')
    _, half = one_step(prepared, tmp_path / 'half', '--router_lr_mult=0.5')
    _, nodecay = one_step(prepared, tmp_path / 'nodecay', '--router_decay=False')
    start = initial(c).state_dict()
    lr = train.lr_at(0, c, 1)
    for name, p in start.items():
        if 'router' in name:  # AdamW's step (decay included) is proportional to the learning rate
            torch.testing.assert_close(half[name] - p, 0.5 * (full[name] - p),
                                       rtol=1e-4, atol=1e-8)
            # without decay the step lacks AdamW's lr * wd * p (atol: float32 steps of p, 1,000x
            # below that)
            torch.testing.assert_close(nodecay[name] - full[name], lr * c.weight_decay * p,
                                       rtol=1e-4, atol=1e-8)
            assert not torch.equal(full[name], p)
        else:
            assert torch.equal(half[name], full[name]), name
            assert torch.equal(nodecay[name], full[name]), name


def test_sample_rebuilds_a_run_saved_before_the_variant_keys(tmp_path):
    torch.manual_seed(0)
    c = config()
    model = train.Transformer(c)
    new_keys = ('bias_rate', 'shared_hidden', 'router_init_std', 'router_lr_mult', 'router_decay')
    old_config = {k: v for k, v in vars(c).items() if k not in new_keys}
    runs.save(str(tmp_path / 'best.pt'), {
        'model': model.state_dict(), 'config': old_config,
        'meta': {'tokenizer': 'bytes', 'vocab_size': 257, 'eot_id': 256}})
    loaded, _ = sample.load_model(str(tmp_path), 'cpu')
    x = torch.randint(0, 257, (1, 8))
    assert torch.equal(loaded(x)[0], model.eval()(x)[0])
