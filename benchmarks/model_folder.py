"""Another copy of the model folder (`src/kdamoe/model`, e.g. `git archive REV src/kdamoe/model | tar -x -C alt/NAME
--strip-components=3`) imported as a package of its own beside the installed one, for an A/B of two versions in one
process. The benchmarks run as scripts, so this folder is on `sys.path` and they import it as `model_folder`."""

import importlib
import importlib.machinery
import importlib.util
import os
import re
import sys
import types


def import_model_folder(label: str, path: str, module: str):
    """Module `module` (e.g. ``"short_conv"``) of the model folder at `path`, in a package named after `label` (the
    folder's modules import each other relatively)."""
    package = "kdamoe_alt_" + re.sub(r"\W", "_", label)
    if package not in sys.modules:
        spec = importlib.machinery.ModuleSpec(package, None, is_package=True)
        spec.submodule_search_locations = [os.path.abspath(path)]
        sys.modules[package] = importlib.util.module_from_spec(spec)
    return importlib.import_module(f"{package}.{module}")


def load_model_classes(label: str, path: str) -> types.SimpleNamespace:
    """`KDAMoEConfig` and `KDAMoEForCausalLM` of the model folder at `path`, imported as a package of its own."""
    return types.SimpleNamespace(
        KDAMoEConfig=import_model_folder(label, path, "configuration_kdamoe").KDAMoEConfig,
        KDAMoEForCausalLM=import_model_folder(label, path, "modeling_kdamoe").KDAMoEForCausalLM)
