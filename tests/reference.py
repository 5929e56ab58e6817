"""An independent JSON Schema 2020-12 validator to check our compiled one against.

``jsonschema`` applies ``pattern`` with Python's ``re.search``, where ``$``
also matches before a trailing newline; ECMA-262 (which JSON Schema
specifies) does not. The reference validator fixes that one keyword.
"""

import json
import re
from functools import lru_cache

import jsonschema
from jsonschema import validators

from pipeline.contract import SCHEMA_DIR


def _ecma_pattern(validator, pattern, instance, schema):
    if validator.is_type(instance, "string"):
        anchored = pattern[:-1] + r"\Z" if pattern.endswith("$") else pattern
        if not re.search(anchored, instance):
            yield jsonschema.ValidationError(f"{instance!r} does not match {pattern!r}")


ReferenceValidator = validators.extend(jsonschema.Draft202012Validator, {"pattern": _ecma_pattern})


@lru_cache(maxsize=None)
def reference(name: str):
    schema = json.loads((SCHEMA_DIR / f"{name}.v1.json").read_text())
    ReferenceValidator.check_schema(schema)
    return ReferenceValidator(schema)


def reference_accepts(name: str, document) -> bool:
    return reference(name).is_valid(document)
