"""`import modeling_dcformer` changes no attribute of any transformers or peft object: no wrapped
`Trainer.create_model_card`, no entry in peft's table of default LoRA targets. Its registrations go through the
registries transformers provides for them (`AutoConfig.register`, `AutoModel*.register`, `register_for_auto_class`
of our own classes), which live inside the Auto mappings' own state and are checked separately."""

import json
import subprocess
import sys
import textwrap

SNAPSHOT = textwrap.dedent(
    """
    import json, sys, types
    import peft, peft.utils.constants, transformers, transformers.trainer, transformers.modeling_utils  # noqa: F401

    def state():
        seen = {}
        for name, module in list(sys.modules.items()):
            if not name.startswith(("transformers", "peft")) or not isinstance(module, types.ModuleType):
                continue
            for attr, value in list(vars(module).items()):
                key = f"{name}.{attr}"
                if isinstance(value, dict):
                    seen[key] = repr(sorted(map(str, value)))  # the keys of module-level tables
                elif isinstance(value, type) and value.__module__ == name:
                    seen.update({f"{key}.{k}": repr(id(v)) for k, v in vars(value).items()})
                else:
                    seen[key] = repr(id(value))
        return seen

    before = state()
    import modeling_dcformer  # noqa: F401
    after = state()
    changed = sorted(k for k in before if k in after and before[k] != after[k])
    print(json.dumps({"changed": changed, "registered": "dcformer" in transformers.CONFIG_MAPPING}))
    """
)


AUTO_REGISTRIES = (
    "transformers.models.auto.configuration_auto.CONFIG_MAPPING",
    "transformers.models.auto.modeling_auto.MODEL_MAPPING",
    "transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING",
)


def test_import_changes_no_attribute_of_transformers_or_peft():
    proc = subprocess.run([sys.executable, "-c", SNAPSHOT], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    # the Auto registries gain "dcformer": what `AutoConfig.register` and `AutoModel*.register` are for
    assert report["registered"]
    assert set(report["changed"]) <= set(AUTO_REGISTRIES), report["changed"]
