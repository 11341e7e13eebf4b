"""Write one section of BENCHMARKS.md, leaving the other scripts' sections alone."""

from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "BENCHMARKS.md"
TITLE = "# autopar benchmarks\n"


def write_section(name: str, body: str, path: Path = BENCHMARKS) -> None:
    """Replace the text between ``<!-- name:begin -->`` and ``<!-- name:end -->`` (append if new)."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    text = path.read_text() if path.exists() else TITLE
    block = f"{begin}\n{body.strip()}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)


def publish(name: str, section: str, quick: bool) -> None:
    """Print the section; a full run (not ``--quick``) also writes it into BENCHMARKS.md."""
    print(section)
    if not quick:
        write_section(name, section)
        print(f"[{name}] wrote its section of {BENCHMARKS}")
