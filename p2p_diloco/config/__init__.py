"""Typed run configuration: sections loaded from TOML, overridden by ``--section.key=value``.

Every field carries a help text and, where it has one, a unit; ``describe()`` renders them for ``--help``.
Unknown keys and ill-typed or out-of-range values raise :class:`ConfigError` naming the key, which the CLI turns
into a one-line message and exit code 2. fields.py declares the field helper, sections.py the sections, load.py
the loading, checking and printing.
"""

from p2p_diloco.config.fields import AUTO, ConfigError, FloatOrAuto
from p2p_diloco.config.load import (COMMAND_LINE, COMMON_KEYS, TESTING_SECTIONS, all_keys, check_config,
                                    config_from_dict, copy_config, describe, dump_toml, load_config, parse_overrides,
                                    set_value, shared_keys, shared_settings, show_value, suggest_keys)
from p2p_diloco.config.sections import (SECTIONS, AveragingConfig, Config, DataConfig, DiLoCoConfig, FaultConfig,
                                        InnerConfig, ModelConfig, NetworkConfig, RunConfig)

__all__ = ["AUTO", "ConfigError", "FloatOrAuto", "COMMAND_LINE", "COMMON_KEYS", "TESTING_SECTIONS", "all_keys",
           "suggest_keys", "check_config", "config_from_dict", "copy_config", "describe",
           "dump_toml", "load_config", "parse_overrides", "set_value", "shared_keys", "shared_settings", "show_value",
           "SECTIONS", "AveragingConfig", "Config", "DataConfig", "DiLoCoConfig", "FaultConfig", "InnerConfig",
           "ModelConfig", "NetworkConfig", "RunConfig"]
