"""Every name a checkpoint's files and objects carry: the twin of FORMAT.md's "File names".

Readers take data files' and piece tables' names from the manifest, never from a pattern, so
the rules here are what writers give a name and what cleanups and the relay recognise one
by. A local save's staging directory is its own, so there names are plain; in an object
store's prefix, which another save of the same checkpoint may share, every name a save
writes but the manifest carries its token (:func:`spread`).
"""

from __future__ import annotations

import re
import zlib

MANIFEST_FILE = "manifest.json"
# A step retention let go of while newer steps still reference its data files (FORMAT.md, "References").
REFERENCED_FILE = "referenced.json"
STAGING_MARKER = "staging.json"  # the first file of a save's staging area (:func:`marker_name`)
TIER_FILE = "tier.json"  # a local tier step's record of its save (FORMAT.md, "Local tier")
PLAN_FILE = "plan.json"  # a local tier step's plan: every leaf, no piece (decoded with tiled=False)
# What a save into an object store puts before each name it writes there but the manifest
# (:func:`spread`, FORMAT.md "File names"): ``<hash>-<token>-``.
TOKENED = r"[0-9a-f]{4}-(?P<token>[0-9a-f]{1,32})-"
_TOKENED_NAME = re.compile(TOKENED + ".+")
STAGING_DIRECTORY = re.compile(r".+\.tmp-[0-9a-f]+")  # :func:`staging_directory` of any name


def spread(token: str, name: str) -> str:
    """``name`` as a save with ``token`` writes it into an object store's prefix, which it may
    share with another save of the same checkpoint (a stale process, a second job):
    ``<hash>-<token>-<name>``, so that two saves never write the same name, and, the hash
    (4 hex digits of crc32 of token and name) first, one save's objects spread over the
    prefix's key range instead of a run of neighbouring keys (FORMAT.md, "File names").
    Unchanged without a token (a local save, whose staging directory is its own)."""
    return f"{zlib.crc32(f'{token}/{name}'.encode()) & 0xFFFF:04x}-{token}-{name}" if token else name


def token_of(name: str) -> str | None:
    """The token of the save that wrote ``name`` (any name :func:`spread` made): which
    save's objects a name is, in a prefix several saves of one checkpoint may share; None
    for a name that carries none."""
    match = _TOKENED_NAME.fullmatch(name)
    return None if match is None else match["token"]


def data_file_name(process: int, number: int, token: str = "") -> str:
    """Data file ``number`` of ``process``; a save into an object store passes its token,
    which the name then carries after a short hash (:func:`spread`)."""
    return spread(token, f"d{process:05d}-{number:05d}.safetensors")


def staged_index_file(process: int, token: str = "") -> str:
    """Where a process other than the leader leaves its piece locations for the commit
    (binary rows: ``format.encode_index``); the commit deletes it. A local tier's part keeps
    its own under this name, merged at a tier restore. ``token``: as for :func:`data_file_name`."""
    return spread(token, f"index-{process:05d}.bin")


def values_file_name(process: int, token: str = "") -> str:
    """The file holding ``process``'s per-process values (``token``: as for :func:`data_file_name`)."""
    return spread(token, f"values-{process:05d}.bin")


def table_prefix(token: str) -> str:
    """What the names of the piece tables of a save with ``token`` start with (:func:`table_file`)."""
    return spread(token, "")


def table_file(number: int, prefix: str = "") -> str:
    """Piece table ``number``, its name started by ``prefix`` (:func:`table_prefix`)."""
    return f"{prefix}pieces-{number:05d}.bin"


_OWNED_FILE = re.compile(
    rf"(?:{TOKENED})?(?:d(\d{{5,9}})-\d{{5,9}}\.safetensors|index-(\d{{5,9}})\.(?:json|bin)|values-(\d{{5,9}})\.bin)"
)


def written_by(name: str) -> int | None:
    """The process whose data file, index or values file ``name`` is (as named above, with or without a
    token: checkpoints saved before names carried one name them ``dPPPPP-NNNNN.safetensors``);
    None for any other name."""
    match = _OWNED_FILE.fullmatch(name)
    return None if match is None else int(match[2] or match[3] or match[4])


def marker_name(token: str, *, local: bool) -> str:
    """The name of the staging marker of the save with ``token``. On an object store, whose
    prefix several saves of one checkpoint may share, each save's own (:func:`spread`, like
    its other objects): a save deletes its own marker with its objects, never another's, and
    ``tpu-ckpt gc`` reads each save's age from its own. A local staging directory is the
    save's own: there it is plain ``staging.json``."""
    return STAGING_MARKER if local else spread(token, STAGING_MARKER)


def is_marker(name: str) -> bool:
    """Whether ``name`` is a staging marker: a save's own (:func:`marker_name`), or the plain
    one (local saves, and object-store saves of versions before markers were per save)."""
    token = token_of(name)
    return name == STAGING_MARKER or (token is not None and name == spread(token, STAGING_MARKER))


def left_by_a_save(name: str) -> bool:
    """Whether ``name`` is a file a save writes before its manifest (a data, index or values
    file, a staging marker, any object named with a save's token): what an uncommitted save
    leaves behind, as opposed to files of anything else."""
    return is_marker(name) or token_of(name) is not None or written_by(name) is not None


def staging_directory(path: str, token: str) -> str:
    """Where a local save of ``path`` writes before its commit renames it onto ``path``."""
    return f"{path}.tmp-{token}"
