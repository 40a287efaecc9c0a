"""The JSON presets of DCFormerConfig, installed as `modeling_dcformer.configuration`.

Load one by name with `DCFormerConfig.from_preset("dcpythia-6.9b")`; `DCFormerConfig.preset_names()` lists them.
"""
