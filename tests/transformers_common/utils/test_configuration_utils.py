"""Stand-in (written for expertize, not transformers' file) for `tests/utils/test_configuration_utils.py`, which the
transformers sdist does not ship: `config_common_kwargs`, every field of `PreTrainedConfig` set to a value other than
its default. `ConfigTester.check_config_arguments_init` builds a config from them and checks that each one sticks."""

config_common_kwargs = {
    "architectures": ["ExpertizeProbeModel"],
    "output_hidden_states": True,
    "return_dict": False,
    "dtype": "float16",
    "chunk_size_feed_forward": 5,
    "id2label": {0: "first", 1: "second"},
    "label2id": {"first": 0, "second": 1},
    "problem_type": "regression",
}
