"""Where results go, what a recorded result carries about its origin, and the rule for recording.

- bench/results/ (RESULTS, tracked): the committed record the README and docs quote. Written only with
  --save, and only from a clean tree: every writer calls `require_clean(folder)` before it measures and
  again before it writes, so no committed result is stamped '+dirty'. Changes under bench/results/
  itself do not count (re-measuring one table after another leaves the earlier ones modified).
- bench/out/ (SCRATCH, git-ignored): every other run, unless --out names another folder.
- the stamp (`stamp`, on every JSON a tool of bench/ writes): the date, the commit (`commit`), the tree
  that ran (`tree`: `tree_hash`, a hash of the files' contents computed without git, so that a machine
  with a copy of the tree and no repository names it too), whether that tree was committed
  (`tree_committed`: False, and `uncommitted` lists the changes, when git sees changed tracked files or
  untracked source files that the hash covers; without git, True only when $GTPO_COMMITTED_TREE, the hash
  of a clean checkout computed where git is, equals it, else None: unknown), the machine (`machine`) and
  the versions (`versions`). `python -m bench.common.record RECORD...` checks, on a clean checkout, that
  each record's tree is this commit's and refuses a record marked uncommitted.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
RESULTS = os.path.join(ROOT, "bench", "results")
SCRATCH = os.path.join(ROOT, "bench", "out")


def _git(root, *args):
    """git's stdout in `root`, or None when git or the repository is missing."""
    try:
        p = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout if p.returncode == 0 else None


def tracked_changes(root=ROOT) -> list:
    """`git status --porcelain` lines of tracked files changed in `root`'s repository, bench/results/
    excluded; [] when clean or not a git checkout."""
    out = _git(root, "status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)bench/results")
    return [ln for ln in (out or "").splitlines() if ln.strip()]


TREE_PARTS = ("gtpo_kernels", "reference", "bench", "tests", "examples", "setup.py")


def tree_hash(root=ROOT) -> str:
    """sha256 over the paths and contents of the tree's source files (.py, .sh, setup.py), bench/results/
    and bench/out/ left out: the same on any copy of the same tree, with or without git."""
    import hashlib
    h = hashlib.sha256()
    files = []
    for part in TREE_PARTS:
        full = os.path.join(root, part)
        if os.path.isfile(full):
            files.append(part)
            continue
        for d, dirs, names in os.walk(full):
            rel = os.path.relpath(d, root)
            dirs[:] = sorted(x for x in dirs if x not in ("__pycache__", ".hypothesis")
                             and os.path.join(rel, x) not in ("bench/results", "bench/out"))
            files += [os.path.join(rel, n) for n in names if n.endswith((".py", ".sh"))]
    for rel in sorted(files):
        with open(os.path.join(root, rel), "rb") as f:
            h.update(rel.encode() + b"\0" + f.read() + b"\0")
    return h.hexdigest()[:16]


def untracked_sources(root=ROOT) -> list:
    """`git status --porcelain` lines of untracked files that tree_hash covers (.py and .sh under
    TREE_PARTS); [] when none or not a git checkout."""
    out = _git(root, "status", "--porcelain", "--untracked-files=all", "--", *TREE_PARTS)
    return [ln for ln in (out or "").splitlines() if ln.startswith("??") and ln.rstrip().endswith((".py", ".sh"))
            and not any(x in ln for x in ("bench/results/", "bench/out/"))]


def is_git(root=ROOT) -> bool:
    return _git(root, "rev-parse", "--git-dir") is not None


def tree_state(root=ROOT) -> dict:
    """{tree, commit, tree_committed, uncommitted}: the tree that runs and whether it is a commit's (see
    the module's docstring for the rule without git)."""
    tree = tree_hash(root)
    if is_git(root):
        changes = tracked_changes(root) + untracked_sources(root)
        return dict(tree=tree, commit=commit(root), tree_committed=not changes, uncommitted=changes[:20])
    expected = os.environ.get("GTPO_COMMITTED_TREE") or None
    return dict(tree=tree, commit=None, tree_committed=None if expected is None else expected == tree,
                uncommitted=[] if expected in (None, tree) else [f"tree {tree} is not the committed {expected}"])


def stamp(device="cpu") -> dict:
    """What every record carries about its origin: date, commit, tree, tree_committed, uncommitted,
    machine, versions."""
    now = datetime.datetime.now(datetime.timezone.utc)
    return dict(date=now.isoformat(timespec="seconds"), **tree_state(), machine=machine(device), versions=versions())


def commit(root=ROOT):
    """The commit the figures were measured on ('+dirty' when tracked files had changes), or None."""
    head = (_git(root, "rev-parse", "HEAD") or "").strip()
    return (head + ("+dirty" if tracked_changes(root) else "")) or None


def is_results(folder) -> bool:
    """Whether `folder` is bench/results/ or inside it."""
    folder, results = os.path.realpath(folder), os.path.realpath(RESULTS)
    return folder == results or folder.startswith(results + os.sep)


class DirtyTree(SystemExit):
    """Raised instead of writing into bench/results/ from a tree with uncommitted changes."""


def require_clean(folder, changes=None):
    """Refuses (DirtyTree, a SystemExit: the command exits with its message) to record into bench/results/
    while tracked files outside it have uncommitted changes; any other folder is always fine."""
    if not is_results(folder):
        return
    changes = tracked_changes() if changes is None else changes
    if changes:
        shown = "\n  ".join(changes[:10]) + ("\n  ..." if len(changes) > 10 else "")
        raise DirtyTree(f"refusing to record into {os.path.relpath(folder, ROOT)}: the tree has uncommitted changes "
                        f"(a committed result must name the commit it was measured on):\n  {shown}\n"
                        f"commit or stash them first, or write elsewhere (--out DIR, or no --save).")


def machine(device="cpu"):
    import torch
    m = dict(platform=platform.platform(), python=platform.python_version(), cpu=platform.processor(),
             cpu_count=os.cpu_count())
    try:
        with open("/proc/cpuinfo") as f:
            m["cpu"] = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        m.update(gpu=p.name, gpu_memory_bytes=p.total_memory, capability=list(torch.cuda.get_device_capability(0)),
                 cuda=torch.version.cuda)
    return m


def versions():
    import torch
    v = dict(torch=torch.__version__)
    for mod in ("triton", "gtpo_kernels", "liger_kernel", "numpy", "matplotlib"):
        try:
            m = __import__(mod)
            v[mod] = getattr(m, "__version__", "?")
        except Exception:
            v[mod] = None
    from importlib.metadata import version
    for mod, dist in (("liger_kernel", "liger-kernel"), ("trl", "trl")):
        if v.get(mod, "?") == "?":  # no __version__ (Liger), or not imported: importing trl takes seconds
            try:
                v[mod] = version(dist)
            except Exception:
                v[mod] = None
    return v


def write_json(res, out_dir, prefix=""):
    """<prefix><device>-<date>.json and latest-<prefix><device>.json in out_dir, stamped with the date,
    commit, machine and versions; returns the first path. Into bench/results/ only from a clean tree."""
    require_clean(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    doc = dict(stamp(res["device"]), **res)
    now = datetime.datetime.fromisoformat(doc["date"])
    path = os.path.join(out_dir, f"{prefix}{res['device']}-{now.strftime('%Y%m%d-%H%M%S')}.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    with open(os.path.join(out_dir, f"latest-{prefix}{res['device']}.json"), "w") as f:
        json.dump(doc, f, indent=1, default=str)
    return path


def check_records(paths) -> int:
    """Each record's `tree` against this checkout's (which must be clean), and none marked as measured on
    an uncommitted tree (`tree_committed` False): 0 when all hold."""
    bad = 0
    if tracked_changes():
        print("the checkout has uncommitted changes: commit first")
        return 1
    here = tree_hash()
    for p in paths:
        with open(p) as f:
            rec = json.load(f)
        ok = rec.get("tree") == here and rec.get("tree_committed") is not False
        bad += not ok
        marked = " (marked: measured on an uncommitted tree)" if rec.get("tree_committed") is False else ""
        print(f"{'ok ' if ok else 'BAD'} {p}: tree {rec.get('tree')}{marked} (this commit's: {here})")
    return int(bad > 0)


if __name__ == "__main__":
    import sys
    if len(sys.argv) == 2 and sys.argv[1] == "--tree":
        print(tree_hash())
    elif len(sys.argv) == 2 and sys.argv[1] == "--state":  # one line of JSON: tree_state()
        print(json.dumps(tree_state()))
    else:
        sys.exit(check_records(sys.argv[1:]))
