"""Typed configuration: the generic machinery (`core`) and the training job's tree (`job`)."""

from stalwart.config.core import ConfigError, build, help_text, load, option, section, to_dict, to_toml

__all__ = ["ConfigError", "build", "help_text", "load", "option", "section", "to_dict", "to_toml"]
