"""shadow_vllm.tiny_model: the tests' model keeps its shape, and a larger
one (for the repack figures) is the same kind of checkpoint, bigger.
Runs in the virtualenv (``make test-vllm-unit``): numpy, safetensors,
tokenizers."""

import json
import os
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
PKG = os.path.dirname(HERE)
sys.path[:0] = [PKG]

from shadow_vllm import tiny_model  # noqa: E402


class Shape(unittest.TestCase):
    def test_the_default_is_the_tests_model(self):
        s = tiny_model.Shape()
        self.assertEqual((s.hidden, s.layers, s.intermediate, s.heads, s.kv_heads), (256, 2, 512, 4, 2))

    def test_a_shape_vllm_cannot_split_into_heads_is_refused(self):
        for hidden, layers in ((100, 2), (64, 2), (256, 0), (256, 65)):
            with self.assertRaises(ValueError):
                tiny_model.Shape(hidden, layers)

    def test_a_larger_model_has_the_shape_asked_for(self):
        d = tempfile.TemporaryDirectory()
        self.addCleanup(d.cleanup)
        self.assertEqual(tiny_model.main([d.name, "--hidden", "384", "--layers", "3"]), 0)
        with open(os.path.join(d.name, "config.json")) as f:
            config = json.load(f)
        self.assertEqual((config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"],
                          config["num_attention_heads"], config["num_key_value_heads"]), (384, 3, 768, 6, 3))
        from safetensors.numpy import load_file

        w = load_file(os.path.join(d.name, "model.safetensors"))
        self.assertEqual(w["model.layers.2.self_attn.k_proj.weight"].shape, (3 * 64, 384))
        self.assertEqual(w["model.layers.2.mlp.down_proj.weight"].shape, (384, 768))
        self.assertNotIn("model.layers.3.mlp.up_proj.weight", w)


if __name__ == "__main__":
    unittest.main()
