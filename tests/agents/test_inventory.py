from pathlib import Path

import pytest

from agents.discovery import DiscoveryError
from agents.discovery.inventory import InventorySource, parse_inventory
from agents.protocol import GpuInventory


def test_parses_models_and_defaults_allocatable_to_count():
    gpus = parse_inventory(
        "gpus:\n"
        "  - {model: A100-80GB, memory_gib: 80, count: 8}\n"
        "  - {model: L4, memory_gib: 24, count: 4, allocatable: 2, utilization: 0.5}\n"
    )
    assert gpus == [
        GpuInventory(model="A100-80GB", memory_gib=80, count=8, allocatable=8),
        GpuInventory(model="L4", memory_gib=24, count=4, allocatable=2, utilization=0.5),
    ]


def test_empty_gpu_list_is_a_cluster_without_gpus():
    assert parse_inventory("gpus: []") == []


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("gpus: [{model: A100, memory_gib: -1, count: 8}]", "gpus[0].memory_gib: "),
        ("gpus: [{model: A100, memory_gib: 80}]", "gpus[0].count: Field required"),
        ("gpus: [{model: A100, memory_gib: 80, count: eight}]", "gpus[0].count: "),
        ("gpus: [{model: '', memory_gib: 80, count: 1}]", "gpus[0].model: "),
        (
            "gpus: [{model: A, memory_gib: 8, count: 2, allocatable: 3}]",
            "gpus[0]: allocatable (3) exceeds count (2)",
        ),
        ("gpus: [{model: A, memory_gib: 8, count: 1, colour: red}]", "gpus[0].colour: "),
        (
            "gpus: [{model: A, memory_gib: 8, count: 1}, {model: A, memory_gib: 8, count: 1}]",
            "gpus[1].model: duplicate model 'A'",
        ),
        ("gpus: {model: A}", "gpus: "),
        ("nodes: []", "gpus: Field required"),
        ("- just a list", "expected a mapping with a 'gpus' list"),
        ("", "expected a mapping with a 'gpus' list"),
        ("gpus: [\n  {model: A,\n", "not valid YAML at line"),
    ],
)
def test_bad_files_name_the_field(text, expected):
    with pytest.raises(DiscoveryError) as info:
        parse_inventory(text, "inv.yaml")
    message = str(info.value)
    assert message.startswith("--inventory: inv.yaml: ")
    assert expected in message
    assert "\n" not in message


def test_missing_file_fails_at_load(tmp_path: Path):
    with pytest.raises(DiscoveryError, match=r"--inventory: .*nope.yaml: cannot read"):
        InventorySource.load(tmp_path / "nope.yaml")


def test_source_rereads_the_file(tmp_path: Path):
    path = tmp_path / "inv.yaml"
    path.write_text("gpus: [{model: A, memory_gib: 8, count: 1}]")
    src = InventorySource.load(path)
    assert src.source == "inventory"
    path.write_text("gpus: [{model: A, memory_gib: 8, count: 5}]")
    assert [g.count for g in src.collect()] == [5]
