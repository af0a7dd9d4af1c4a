"""Reading docker-compose.yml the way Compose does: YAML (anchors and merge keys), then
variable interpolation (`$$`, `${VAR}`, `${VAR:-default}`, `${VAR:?error}`, ...)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
PROJECT_IMAGE = "billing-orchestrator"

_VARIABLE = re.compile(
    r"\$(?:(?P<escaped>\$)"
    r"|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>[^}$]*))?\}"
    r"|(?P<named>[A-Za-z_][A-Za-z0-9_]*)"
    r"|(?P<invalid>))"
)


@dataclass
class Interpolation:
    """Variables seen while interpolating: those that must be set, and their defaults."""

    env: dict[str, str]
    required: set[str] = field(default_factory=set)
    defaults: dict[str, str] = field(default_factory=dict)
    used: set[str] = field(default_factory=set)

    def value(self, text: str) -> str:
        return _VARIABLE.sub(self._replace, text)

    def _replace(self, match: re.Match[str]) -> str:
        if match["escaped"]:
            return "$"
        if match["invalid"] is not None:
            raise ValueError(f"invalid interpolation at {match.string[match.start() :]!r}")
        name = match["braced"] or match["named"]
        op, arg = match["op"] or "", match["arg"] or ""
        self.used.add(name)
        value = self.env.get(name)
        unset = value is None or (op.startswith(":") and value == "")
        if op.endswith("?"):
            self.required.add(name)
            if unset:
                # Compose would stop here with `arg` as the message; the check goes on.
                return f"<{name}>"
        if op.endswith("-"):
            self.defaults[name] = arg
            return arg if unset else str(value)
        if op.endswith("+"):
            return "" if unset else arg
        return "" if value is None else value

    def tree(self, node: Any) -> Any:
        if isinstance(node, str):
            return self.value(node)
        if isinstance(node, dict):
            return {key: self.tree(value) for key, value in node.items()}
        if isinstance(node, list):
            return [self.tree(value) for value in node]
        return node


def load(env: dict[str, str] | None = None) -> tuple[dict[str, Any], Interpolation]:
    raw = yaml.safe_load(COMPOSE_FILE.read_text())
    interpolation = Interpolation(env or {})
    return interpolation.tree(raw), interpolation


def is_project_service(service: dict[str, Any]) -> bool:
    return str(service.get("image", "")).split(":")[0] == PROJECT_IMAGE
