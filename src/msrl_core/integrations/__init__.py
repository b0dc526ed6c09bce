"""Adapters that let existing RL frameworks use msrl_core without editing them (docs/integrations.md)."""
