"""A text corpus with a held-out split, assembled offline from the documentation every CPython ships.

Sources, both part of every CPython installation and both under the PSF License Agreement
(https://docs.python.org/3/license.html):

- ``pydoc_data.topics``: the Language Reference and library topics as plain text (what
  ``help("assert")`` prints), generated from the Python documentation sources. One document per topic,
  named ``topic:<name>``.
- The docstrings of the pure-Python standard-library modules: module, class and function docstrings,
  read from the ``.py`` sources with ``ast`` (nothing is imported). One document per module, named
  ``module:<dotted.name>``: the module docstring, then each class/function docstring under a line with
  its qualified name. Test packages (``test``, ``tests``, ``idle_test``) and ``site-packages`` are left out.

Split: a document is held out (validation) when ``zlib.crc32(name) % 20 == 0``, about 1 document in 20.
The rule depends only on the document's name, so a topic or module is on the same side of the split in
every Python version that ships it. Some text appears in more than one document (pydoc topics nest:
a section is also part of its parent's topic; some modules share docstrings), so paragraphs of a
held-out document that also appear in a training document are removed from it: the validation text
is text the model has not been trained on. Documents are sorted by name and joined with blank lines.

Files written into the data directory: ``train.txt``, ``valid.txt`` (UTF-8) and ``manifest.json``
(sources, licence, Python version, document names per split, byte counts, sha256). The text differs
between Python versions, so the default directory is ``examples/out/corpus/cpython-<version>``; it is
built on first use (a few seconds) and read back afterwards.

    python examples/python_docs_corpus.py            # build (if needed) and print the split sizes
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import platform
import sys
import sysconfig
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
FORMAT = 2  # bump when the assembly rules change, so cached copies are rebuilt
HOLDOUT_EVERY = 20
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "pydoc_data"}
MIN_DOCSTRING_CHARS = 40
SOURCES = (
    "pydoc_data.topics (Python Language Reference and library topics as plain text) and the module, class "
    "and function docstrings of the pure-Python standard library, from this CPython installation"
)
LICENCE = "PSF License Agreement for Python (https://docs.python.org/3/license.html)"


def python_version() -> str:
    return f"{platform.python_implementation()}-{platform.python_version()}"


def default_dir() -> str:
    return os.path.join(HERE, "out", "corpus", python_version().lower())


def is_held_out(name: str) -> bool:
    return zlib.crc32(name.encode("utf-8")) % HOLDOUT_EVERY == 0


def _topic_documents() -> list[tuple[str, str]]:
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions package the documentation topics separately
        return []
    return [(f"topic:{key}", text.strip()) for key, text in topics.items() if text.strip()]


def _docstrings(tree: ast.Module) -> list[str]:
    """Module docstring, then each class/function docstring under its qualified name, in source order."""
    parts = []
    doc = ast.get_docstring(tree, clean=True)
    if doc and len(doc) >= MIN_DOCSTRING_CHARS:
        parts.append(doc)

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                doc = ast.get_docstring(child, clean=True)
                if doc and len(doc) >= MIN_DOCSTRING_CHARS:
                    parts.append(f"{name}:\n{doc}")
                visit(child, name + ".")

    visit(tree, "")
    return parts


def _module_documents(stdlib: str) -> list[tuple[str, str]]:
    docs = []
    for root, dirs, files in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith((".", "config-")))
        for fname in sorted(files):
            if not fname.endswith(".py"):
                continue
            path = os.path.join(root, fname)
            rel = os.path.relpath(path, stdlib)[: -len(".py")].split(os.sep)
            if rel[-1] == "__init__":
                rel = rel[:-1]
            try:
                with open(path, "rb") as f:
                    tree = ast.parse(f.read(), filename=path)
            except (SyntaxError, ValueError, UnicodeDecodeError, OSError):
                continue  # a file this interpreter cannot parse carries no usable docstrings
            parts = _docstrings(tree)
            if parts:
                docs.append(("module:" + ".".join(rel), "\n\n".join(parts)))
    return docs


def assemble(stdlib: str | None = None) -> list[tuple[str, str]]:
    """``[(name, text)]`` sorted by name: the pydoc topics and the stdlib docstring documents."""
    stdlib = stdlib or sysconfig.get_paths()["stdlib"]
    docs = _topic_documents() + _module_documents(stdlib)
    docs = [(name, "\n".join(line.rstrip() for line in text.splitlines())) for name, text in docs]
    return sorted(docs)


def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def split(docs: list[tuple[str, str]]) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """``(train, valid)`` documents: :func:`is_held_out` by name, then training paragraphs removed from valid."""
    train = [(n, t) for n, t in docs if not is_held_out(n)]
    seen = {p.strip() for _, t in train for p in t.split("\n\n")}
    valid = []
    for name, text in docs:
        if is_held_out(name):
            kept = [p for p in text.split("\n\n") if p.strip() not in seen or len(p.strip()) < MIN_DOCSTRING_CHARS]
            text = "\n\n".join(kept).strip()
            if text:
                valid.append((name, text))
    return train, valid


def build(data_dir: str) -> dict:
    """Assembles the corpus and writes train.txt, valid.txt and manifest.json into ``data_dir``."""
    docs = assemble()
    train, valid = split(docs)
    if not train or not valid or sum(len(t) for _, t in docs) < 100_000:
        raise SystemExit(
            f"python_docs_corpus: found only {len(docs)} documents in {sysconfig.get_paths()['stdlib']} "
            "(this Python ships without its documentation topics or .py sources); pass --data-dir with a "
            "directory holding your own train.txt and valid.txt"
        )
    os.makedirs(data_dir, exist_ok=True)
    blobs = {}
    for name, part in (("train", train), ("valid", valid)):
        blobs[name] = ("\n\n".join(t for _, t in part) + "\n").encode("utf-8")
        _write_atomic(os.path.join(data_dir, f"{name}.txt"), blobs[name])
    manifest = {
        "format": FORMAT,
        "python": python_version(),
        "sources": SOURCES,
        "licence": LICENCE,
        "split": f"valid = documents with zlib.crc32(name) % {HOLDOUT_EVERY} == 0",
        "bytes": {s: len(b) for s, b in blobs.items()},
        "sha256": {s: hashlib.sha256(b).hexdigest() for s, b in blobs.items()},
        "documents": {"train": [n for n, _ in train], "valid": [n for n, _ in valid]},
    }
    _write_atomic(os.path.join(data_dir, "manifest.json"), json.dumps(manifest, indent=1).encode("utf-8"))
    return manifest


def _is_current(data_dir: str) -> bool:
    """train.txt and valid.txt exist and, where a manifest says how they were built, match this builder."""
    if not all(os.path.exists(os.path.join(data_dir, f"{s}.txt")) for s in ("train", "valid")):
        return False
    path = os.path.join(data_dir, "manifest.json")
    if not os.path.exists(path):
        return True  # a user-provided train.txt / valid.txt pair
    with open(path) as f:
        manifest = json.load(f)
    return manifest.get("format") == FORMAT and manifest.get("python") == python_version()


def load(data_dir: str | None = None, verbose: bool = True):
    """``(train, valid, info)``: the two splits as uint8 byte arrays and a dict describing them.

    Reads ``train.txt`` / ``valid.txt`` from ``data_dir`` (default :func:`default_dir`); when they are
    missing, or were built by another Python version or builder format, assembles the Python-docs corpus
    there first.
    """
    import numpy as np

    data_dir = data_dir or default_dir()
    if not _is_current(data_dir):
        if verbose:
            print(f"assembling the Python documentation corpus into {data_dir} ...", file=sys.stderr, flush=True)
        build(data_dir)
    out = []
    for name in ("train", "valid"):
        with open(os.path.join(data_dir, f"{name}.txt"), "rb") as f:
            out.append(np.frombuffer(f.read(), np.uint8))
    info = {"dir": data_dir, "train_bytes": int(out[0].size), "valid_bytes": int(out[1].size)}
    path = os.path.join(data_dir, "manifest.json")
    if os.path.exists(path):
        with open(path) as f:
            manifest = json.load(f)
        info.update(python=manifest["python"], sources=manifest["sources"], licence=manifest["licence"],
                    train_documents=len(manifest["documents"]["train"]),
                    valid_documents=len(manifest["documents"]["valid"]))  # fmt: skip
    return out[0], out[1], info


def main(argv=None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data-dir", default=None, help=f"default: {default_dir()}")
    ap.add_argument("--rebuild", action="store_true", help="assemble again even when a current copy exists")
    args = ap.parse_args(argv)
    data_dir = args.data_dir or default_dir()
    if args.rebuild:
        build(data_dir)
    _, _, info = load(data_dir)
    print(json.dumps(info, indent=1))


if __name__ == "__main__":
    main()
