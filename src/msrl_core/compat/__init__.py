"""Drop-in replacements for other projects' modules, over msrl_core's own planes (docs/integrations.md)."""
