"""The JSON presets of DCFormerConfig, installed as `modeling_dcformer.configuration`, and the one place that
resolves a preset name.

Load one by name with `DCFormerConfig.from_preset("dcpythia-6.9b")`; `preset_names()` here lists them. Tools
that take "a preset name or a config file" (`dcformer-train --config_name`, `compare_small.py --shape`) resolve
it with `config_file`.
"""

from pathlib import Path

PRESET_DIR = Path(__file__).resolve().parent


def preset_names() -> list[str]:
    """The names of the shipped presets, sorted (`dcformer-tiny`, `dcpythia-6.9b`, ...)."""
    return sorted(path.stem for path in PRESET_DIR.glob("*.json"))


def preset_file(name: str) -> Path:
    """The JSON file of the preset `name` (`dcformer-tiny`, or with its `.json`); a ValueError naming every preset
    when there is no such preset."""
    stem = name[: -len(".json")] if name.endswith(".json") else name
    if stem not in preset_names():
        raise ValueError(f"unknown preset {name!r}; the presets are: {', '.join(preset_names())}")
    return PRESET_DIR / f"{stem}.json"


def config_file(name_or_path: str | Path) -> Path | None:
    """A config JSON file or a preset name -> the file. None when it is neither and does not look like a JSON
    file name (a model directory or a Hub id, for the caller to load); a name ending in `.json` that is neither a
    file nor a preset is a FileNotFoundError that lists the presets."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    name = str(name_or_path)
    stem = name[: -len(".json")] if name.endswith(".json") else name
    if stem in preset_names():
        return preset_file(stem)
    if name.endswith(".json"):
        raise FileNotFoundError(f"config file {name!r} not found (and no preset of that name; the presets are: "
                                f"{', '.join(preset_names())})")
    return None


__all__ = ["PRESET_DIR", "config_file", "preset_file", "preset_names"]
