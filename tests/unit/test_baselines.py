"""DiLoCo-P beside a DiPaCo run: the same everything but the topology, routing and outer step."""

from dipaco.config import load_config_dict
from dipaco.run.baseline import diloco_config


def test_diloco_config_keeps_model_data_and_schedule_and_changes_only_what_diloco_is():
    c = load_config_dict(
        {
            "name": "demo",
            "topology": {"levels": "2x2"},
            "outer": {"rescale": "sqrt", "warmup_rounds": 3},
            "routing": {"discriminative_after": [2]},
            "train": {"rounds": 6, "inner_steps": 7},
        }
    )
    d = diloco_config(c, 4)
    assert d.build_topology().num_paths == 4 and d.topology.levels == "1"
    assert d.routing.method == "iid" and d.routing.discriminative_after == []
    assert (d.outer.lr, d.outer.momentum, d.outer.rescale, d.outer.warmup_rounds) == (
        0.7,
        0.9,
        "none",
        0,
    )
    assert d.model == c.model and d.data == c.data and d.train == c.train
    assert d.name == "demo-diloco4" and not d.baseline
