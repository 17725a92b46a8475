"""tools.code_size: what it counts (non-test Python files git knows) and how it prints."""

from tools import code_size


def test_the_non_test_files_and_their_functions_are_counted(capsys):
    files = code_size.python_files()
    rel = {str(f.relative_to(code_size.ROOT)) for f in files}
    assert "tools/code_size.py" in rel and "bench/campaign.py" in rel
    assert not any(r.startswith("tests/") for r in rel)
    found = dict((where.split(" ")[1], n) for n, where in code_size.functions(
        code_size.ROOT / "tools" / "code_size.py"))
    assert found["python_files"] == 5
    assert code_size.main(["--top", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("README.md lines: ") and max(map(len, out)) <= 80
    assert any(line.startswith("bench/ share: ") for line in out)
