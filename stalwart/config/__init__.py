"""Typed configuration: the generic machinery (`core`), rendering (`render`), the training job's tree
(`job`) and loading it from a command line (`loading`)."""

from stalwart.config.core import ConfigError, build, load, option, section, to_dict
from stalwart.config.render import help_text, to_toml, undocumented_fields

__all__ = ["ConfigError", "build", "help_text", "load", "option", "section", "to_dict", "to_toml",
           "undocumented_fields"]
