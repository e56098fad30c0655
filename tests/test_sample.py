"""sample.py's streaming output: each character printed once its last byte is chosen, and the
whole stream the same text as the samples decoded at the end."""
import torch

import sample
import train
from conftest import config
from prepare import ByteTokenizer


def test_sample_prints_each_character_once_its_last_byte_comes(capsys):
    """Bytes tokens: ë is 2 of them, 🐱 4; each character shows once its last byte is chosen,
    before the next token is, and never as the \ufffd it decodes to until then."""
    tok = ByteTokenizer()
    printed = []  # what was on stdout before each token

    def tokens(ids):
        for i in ids:
            printed.append(capsys.readouterr().out)
            yield i
    text = [*'Zoë 🐱!'.encode(), tok.eot_id]
    sample.print_streaming(tok, [tok.eot_id, *b'once '], tokens(text))
    printed.append(capsys.readouterr().out)
    assert printed == ['once ', 'Z', 'o', '', 'ë', ' ', '', '', '', '🐱', '!', '\n']
    # bytes that are no character stay \ufffd, as in the text decoded at the end
    sample.print_streaming(tok, [], [*b'a\xffb\xc3'])
    assert capsys.readouterr().out == tok.decode(b'a\xffb\xc3') + '\n' == 'a\ufffdb\ufffd\n'


def test_sample_py_streams_the_text_it_prints_whole_at_the_end(tmp_path, capsys):
    """An untrained bytes model writes random bytes, most no UTF-8 character: sample.py's streamed
    stdout is each sample's text decoded once it is finished, then its separator."""
    c = config()
    torch.save({'model': train.Transformer(c).state_dict(), 'config': vars(c),
                'meta': {'tokenizer': 'bytes'}}, tmp_path / 'best.pt')
    sample.main(['--out_dir', str(tmp_path), '--start', 'Zoë', '--num_samples', '2',
                 '--max_new_tokens', '40', '--device', 'cpu'])
    torch.manual_seed(1)  # as sample.py does, before it builds the model
    model, tok = sample.load_model(str(tmp_path), 'cpu')
    prompt = torch.tensor([[tok.eot_id, *tok.encode('Zoë')]])
    whole = ''
    for _ in range(2):
        ids = sample.generate(model, prompt, 40, 0.8, 200, stop_id=tok.eot_id)[0, 1:].tolist()
        whole += tok.decode([i for i in ids if i != tok.eot_id]) + '\n---------------\n'
    out = capsys.readouterr().out
    assert out == whole and out.startswith('Zoë') and '\ufffd' in out
