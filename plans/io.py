"""Reading and writing the files moeplan's users hand it, safely.

Every input file (plans, model and cluster specs, calibration inputs, measured results, the
checkpoint manifest) is read by ``read_text`` / ``read_document``: a regular file only (a device
or FIFO would block or never end; it is refused from ``os.stat`` before opening, and the file is
opened with O_NONBLOCK so one swapped in between cannot block), at most ``MAX_DOCUMENT_BYTES``,
UTF-8, and YAML without alias expansion beyond ``MAX_YAML_NODES`` nodes ("billion laughs") or
recursive aliases. Every output is written by ``write_atomic``: a temporary file from
``tempfile.mkstemp`` in the destination's directory (a name no other file or directory has),
fsync'ed, then ``os.replace``d over the destination, so a reader sees the old file or the new
one, never half of one. Errors are one-line ``SpecError``s naming the file.

Destinations: a regular file is replaced only with ``force``; a FIFO, device, socket or
directory is refused; a symlink is refused too (replacing it would cut the link, writing through
it would change a file the user did not name), so ``--out`` always names the file that changes.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import tempfile
from pathlib import Path

import yaml

from plans.errors import SpecError

MAX_DOCUMENT_BYTES = 64 * 2**20
"""Largest input document: a plan is about 10 kB, a profile or benchmark result under 1 MB."""
MAX_YAML_NODES = 100_000
"""Most YAML nodes a document may expand to through aliases (a plan has a few hundred)."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link"),
                       (stat.S_ISREG, "a file")):
        if test(mode):
            return name
    return "not a regular file"


def _reason(e: OSError) -> str:
    return e.strerror or type(e).__name__


def read_bytes(path: Path, where: str | None = None, limit: int = MAX_DOCUMENT_BYTES) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes; one-line SpecError otherwise."""
    where = where or str(path)
    try:
        st = os.stat(path)
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the name
        raise SpecError(f"{where}: cannot read ({_reason(e) if isinstance(e, OSError) else e})"
                        ) from None
    if not stat.S_ISREG(st.st_mode):
        raise SpecError(f"{where}: cannot read ({_kind(st.st_mode)}, not a regular file)")
    if st.st_size > limit:
        raise SpecError(f"{where}: cannot read ({st.st_size:,} bytes, more than the "
                        f"{limit:,} an input may have)")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise SpecError(f"{where}: cannot read ({_reason(e)})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())  # the file opened, not the name stat'ed above
        if not stat.S_ISREG(st.st_mode):
            raise SpecError(f"{where}: cannot read ({_kind(st.st_mode)}, not a regular file)")
        try:
            data = f.read(limit + 1)
        except OSError as e:
            raise SpecError(f"{where}: cannot read ({_reason(e)})") from None
    if len(data) > limit:
        raise SpecError(f"{where}: cannot read (more than the {limit:,} bytes an input may have)")
    return data


def read_text(path: Path, where: str | None = None, kind: str = "text") -> str:
    """A bounded regular file as UTF-8 text."""
    data = read_bytes(path, where)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecError(f"{where or path}: not valid {kind} (not UTF-8 text: byte {e.start})"
                        ) from None


class BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader that refuses a document whose aliases expand it beyond
    ``MAX_YAML_NODES`` nodes, or refer to a node that contains them (a recursive alias).
    Aliases themselves are fine: the expanded size is counted, once per distinct node."""

    def get_single_node(self):
        node = super().get_single_node()
        if node is not None:
            _expanded_nodes(node)
        return node

    def construct_mapping(self, node, deep=False):
        """A key given twice in one mapping is refused (YAML's spec forbids it; PyYAML keeps
        the last silently)."""
        if isinstance(node, yaml.MappingNode):
            seen = set()
            for key_node, _ in node.value:
                merge = key_node.tag == "tag:yaml.org,2002:merge"
                if isinstance(key_node, yaml.ScalarNode) and not merge:
                    if key_node.value in seen:
                        raise yaml.YAMLError(f"key {key_node.value!r} appears twice")
                    seen.add(key_node.value)
        return super().construct_mapping(node, deep)


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object whose keys are unique (json.loads keeps the last of a repeated key)."""
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} appears twice")
        out[key] = value
    return out


def _expanded_nodes(root: yaml.Node) -> int:
    sizes: dict[int, int] = {}
    open_: set[int] = set()

    def size(node: yaml.Node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in open_:
            raise yaml.YAMLError("a recursive alias (a node that contains itself)")
        open_.add(key)
        total = 1
        if isinstance(node, yaml.SequenceNode):
            total += sum(size(child) for child in node.value)
        elif isinstance(node, yaml.MappingNode):
            total += sum(size(k) + size(v) for k, v in node.value)
        open_.discard(key)
        if total > MAX_YAML_NODES:
            raise yaml.YAMLError(f"aliases expand the document beyond {MAX_YAML_NODES:,} nodes")
        sizes[key] = total
        return total

    return size(root)


def parse_text(text: str, where: str, kind: str) -> object:
    """A JSON (``kind == "json"``) or YAML document; one-line SpecError when it is not one."""
    try:
        return (json.loads(text, object_pairs_hook=_unique_keys) if kind == "json"
                else yaml.load(text, Loader=BoundedLoader))
    except (ValueError, yaml.YAMLError) as e:  # JSONDecodeError, a bad YAML date, huge ints
        reason = (str(e).splitlines() or [type(e).__name__])[0]
        raise SpecError(f"{where}: not valid {kind} ({reason})") from None
    except RecursionError:
        raise SpecError(f"{where}: not valid {kind} (nested too deeply)") from None


def read_document(path: Path, where: str | None = None) -> dict:
    """A bounded YAML or JSON file (by suffix: .json is JSON, anything else YAML) as a mapping."""
    where = where or str(path)
    kind = "json" if path.suffix == ".json" else (path.suffix.lstrip(".") or "yaml")
    data = parse_text(read_text(path, where, kind), where, "json" if kind == "json" else kind)
    if not isinstance(data, dict):
        raise SpecError(f"{where}: expected a mapping at the top level, got {type(data).__name__}")
    return data


# ---- outputs ------------------------------------------------------------------------------------


YAML_SUFFIXES = (".yaml", ".yml")
"""Names written as YAML; every other name is written as JSON (and read_document reads
both)."""


def plan_text(plan, path: Path) -> str:
    """A Plan as the file at ``path`` holds it: YAML for a .yaml or .yml name, else JSON."""
    if path.suffix.lower() in YAML_SUFFIXES:
        return yaml.safe_dump(plan.model_dump(mode="json"), sort_keys=False)
    return plan.model_dump_json(indent=2)


def check_destination(path: Path, what: str, force: bool) -> None:
    """Refuse, before any work, a destination ``write_atomic`` could not or must not replace."""
    where = f"{what}: {path}"
    parent = path.parent
    try:
        pst = os.stat(parent)
    except (FileNotFoundError, NotADirectoryError):
        above = next((p for p in parent.parents if p.exists()), None)
        if above is not None and not above.is_dir():
            raise SpecError(f"{where}: cannot write ({above} is not a folder)") from None
        raise SpecError(f"{where}: cannot write (folder {parent} does not exist)") from None
    except (OSError, ValueError) as e:
        reason = _reason(e) if isinstance(e, OSError) else e
        raise SpecError(f"{where}: cannot write ({reason})") from None
    if not stat.S_ISDIR(pst.st_mode):
        raise SpecError(f"{where}: cannot write ({parent} is not a folder)")
    limit = _name_max(parent)
    if len(os.fsencode(path.name)) > limit:
        raise SpecError(f"{where}: cannot write (file name longer than {limit} bytes)")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    except (OSError, ValueError) as e:
        reason = _reason(e) if isinstance(e, OSError) else e
        raise SpecError(f"{where}: cannot write ({reason})") from None
    if st is not None:
        if not stat.S_ISREG(st.st_mode):
            raise SpecError(f"{where}: is {_kind(st.st_mode)}; give the path of a regular file")
        if not force:
            raise SpecError(f"{where} exists; pass --force to replace it")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise SpecError(f"{where}: cannot write (folder {parent} is not writable)")


def _name_max(folder: Path) -> int:
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def write_atomic(path: Path, data: bytes | str, what: str, force: bool) -> None:
    """Write ``data`` to ``path`` atomically (see the module docstring); never replace an
    existing file unless ``force``. One-line SpecError naming ``what`` (an option) otherwise."""
    check_destination(path, what, force)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    where = f"{what}: {path}"
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name[:64]}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        if not force and os.path.lexists(path):  # appeared since the check
            raise SpecError(f"{where} exists; pass --force to replace it")
        os.replace(tmp, path)
        tmp = None
        _fsync_dir(path.parent)
    except OSError as e:
        reason = "file name too long" if e.errno == errno.ENAMETOOLONG else _reason(e)
        raise SpecError(f"{where}: cannot write ({reason})") from None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# ---- paths a run writes into ----------------------------------------------------------------


def check_appendable(path: Path, what: str) -> None:
    """A file a run appends to (a metrics log): a regular file or a new name in an existing,
    writable folder."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        st = None
    except (OSError, ValueError) as e:
        reason = _reason(e) if isinstance(e, OSError) else e
        raise SpecError(f"{what}: {path}: cannot write ({reason})") from None
    if st is not None:
        if not stat.S_ISREG(st.st_mode):
            raise SpecError(f"{what}: {path} is {_kind(st.st_mode)}; give the path of a file")
        if not os.access(path, os.W_OK):
            raise SpecError(f"{what}: {path} is not writable")
        return
    _check_folder(path.parent, what, path)
    if len(os.fsencode(path.name)) > _name_max(path.parent):
        raise SpecError(f"{what}: {path}: cannot write (file name too long)")


def check_folder_target(path: Path, what: str) -> None:
    """A folder a run creates or writes into (checkpoints): an existing writable folder, or a
    new name whose nearest existing ancestor is a writable folder (created with parents)."""
    probe = path
    while True:
        try:
            st = os.stat(probe)
            break
        except (FileNotFoundError, NotADirectoryError):
            if probe.parent == probe:
                raise SpecError(f"{what}: {path}: no existing folder above it") from None
            probe = probe.parent
        except (OSError, ValueError) as e:
            reason = _reason(e) if isinstance(e, OSError) else e
            raise SpecError(f"{what}: {path}: cannot write ({reason})") from None
    if not stat.S_ISDIR(st.st_mode):
        where = "exists and" if probe == path else f"is under {probe}, which"
        raise SpecError(f"{what}: {path} {where} is {_kind(st.st_mode)}, not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise SpecError(f"{what}: {probe} is not writable")


def _check_folder(folder: Path, what: str, path: Path) -> None:
    try:
        st = os.stat(folder)
    except FileNotFoundError:
        raise SpecError(f"{what}: {path}: folder {folder} does not exist") from None
    except OSError as e:
        raise SpecError(f"{what}: {path}: cannot write ({_reason(e)})") from None
    if not stat.S_ISDIR(st.st_mode):
        raise SpecError(f"{what}: {path}: {folder} is not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise SpecError(f"{what}: {path}: folder {folder} is not writable")
