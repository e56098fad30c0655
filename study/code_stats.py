"""How dense the code reads: per Python file, its lines, the lines over 100 columns, the AST nodes
per code line and the comment lines, as a markdown table.

    python -m study.code_stats train.py runs.py configurator.py report.py bench.py

A code line is a line with a token that is not a comment (docstrings count, blank lines do not); the
nodes are those of Python's ast module without the Load/Store/Del markers, which say how a name is
used rather than add to what a line says. A higher figure means more packed into each line; run it
on nanoGPT's model.py to compare.
"""
import ast
import io
import sys
import tokenize

from errors import UserError, one_line_errors

NOT_CODE = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENDMARKER)


def stats(path):
    """-> (lines, lines over 100 columns, AST nodes per code line, comment lines) of one file."""
    try:
        source = open(path, encoding='utf-8').read()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f'cannot read {path} ({e}); give Python files') from None
    nodes = [n for n in ast.walk(ast.parse(source)) if not isinstance(n, ast.expr_context)]
    code, comments = set(), set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments.add(token.start[0])
        elif token.type not in NOT_CODE:
            code.update(range(token.start[0], token.end[0] + 1))
    if not code:
        raise UserError(f'{path} holds no code')
    lines = source.splitlines()
    long_lines = sum(1 for line in lines if len(line) > 100)
    return len(lines), long_lines, len(nodes) / len(code), len(comments)


def main(paths):
    rows = [(path, *stats(path)) for path in paths]  # every file read before a line is printed
    print('| file | lines | > 100 cols | AST nodes / code line | comment lines |')
    print('|---|---|---|---|---|')
    for path, lines, long_lines, density, comments in rows:
        print(f'| {path} | {lines} | {long_lines} | {density:.1f} | {comments} |')


if __name__ == '__main__':
    with one_line_errors('study.code_stats'):
        main(sys.argv[1:])
