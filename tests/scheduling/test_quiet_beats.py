"""The beat of a node whose agent runs nothing, and that the books say hosts nothing, is one
statement on the agents' worker: most nodes of a large fleet are such nodes, and each beats every
few seconds. It writes what the full beat would have written; a beat that has anything else to do
(a node coming back, a replica to write off or whose command was lost, GPU figures to correct)
is the full beat."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from gpuportal.wire.node_reports import Books
from inference.devices import virtual_gpus
from scheduling.models import GPU, Event, Node, Replica
from scheduling.services import deployments, nodes
from scheduling.services.deployments import DeploymentSpec, ModelFacts
from tests.support.deployments import START, MiB
from tests.support.factories import NO_OVERHEAD

pytestmark = pytest.mark.django_db

EMPTY = {"books": Books(), "running": [], "processes": {}, "arenas": {}}


@pytest.fixture
def box():
    nodes.register_node("box", virtual_gpus("box", "2x1GiB", NO_OVERHEAD), virtual=True)
    return Node.objects.get(name="box")


def test_a_node_that_runs_and_hosts_nothing_beats_in_one_statement(box, django_assert_num_queries):
    nodes.heartbeat("box", **EMPTY)  # the first records its GPUs' figures, the full beat
    now = timezone.now() + timedelta(seconds=5)

    with django_assert_num_queries(1):
        assert nodes.heartbeat("box", now=now, **EMPTY) == []

    box.refresh_from_db()
    assert (box.last_heartbeat, box.status) == (now, Node.Status.ONLINE)


def test_a_node_whose_nvml_figures_are_unchanged_beats_in_one_statement_and_a_change_is_recorded(
    box, django_assert_num_queries
):
    GPU.objects.filter(node=box).update(nvml_free_bytes=900)
    same = Books(free_by_index={"0": 900, "1": 900})
    with django_assert_num_queries(1):
        nodes.heartbeat("box", books=same, running=[])

    nodes.heartbeat("box", books=Books(free_by_index={"0": 800, "1": 900}), running=[])
    assert dict(GPU.objects.filter(node=box).values_list("index", "nvml_free_bytes")) == {0: 800, 1: 900}


def test_a_virtual_node_beside_other_tenants_and_a_warm_spare_beats_in_one_statement_once_they_are_recorded(
    box, django_assert_num_queries
):
    # What a virtual node's agent says with declared tenants and a warm spare: no NVML free figure,
    # the spare's slot counted among the other tenants' use.
    said = Books(foreign_by_index={"0": 300 * MiB, "1": 0}, spare_by_index={"0": 200 * MiB})
    nodes.heartbeat("box", books=said, running=[])  # the first records them, the full beat
    assert gpu_figures(box) == {0: (300 * MiB, 200 * MiB, 1024 * MiB - 300 * MiB), 1: (0, 0, 1024 * MiB)}

    with django_assert_num_queries(1):
        nodes.heartbeat("box", books=said, running=[])
    # A wobble within the books' tolerance (16 MiB) is what the full beat would not record either.
    wobbled = Books(foreign_by_index={"0": 310 * MiB, "1": 0}, spare_by_index={"0": 200 * MiB})
    with django_assert_num_queries(1):
        nodes.heartbeat("box", books=wobbled, running=[])
    assert gpu_figures(box)[0] == (300 * MiB, 200 * MiB, 1024 * MiB - 300 * MiB)
    # An agent that says nothing of them leaves the figures as the books hold them: nothing to do.
    with django_assert_num_queries(1):
        nodes.heartbeat("box", books=Books(), running=[])


@pytest.mark.parametrize(
    "said, recorded",
    [
        # Other tenants took more: past the tolerance, recorded with its Event.
        (Books(foreign_by_index={"0": 500 * MiB}, spare_by_index={"0": 200 * MiB}), (500 * MiB, 200 * MiB)),
        # Gone, however little there was: all of it comes back.
        (Books(foreign_by_index={"0": 0}, spare_by_index={}), (0, 0)),
        # The spare given up, other tenants as they were: only what of their use is the spare changes.
        (Books(foreign_by_index={"0": 300 * MiB}, spare_by_index={}), (300 * MiB, 0)),
    ],
)
def test_a_change_of_other_tenants_or_of_the_spare_is_recorded_by_the_full_beat(box, said, recorded):
    nodes.heartbeat("box", books=Books(foreign_by_index={"0": 300 * MiB}, spare_by_index={"0": 200 * MiB}), running=[])

    nodes.heartbeat("box", books=said, running=[])

    foreign, spare, free = gpu_figures(box)[0]
    assert (foreign, spare) == recorded
    assert free == 1024 * MiB - foreign


def gpu_figures(node: Node) -> dict[int, tuple[int, int, int | None]]:
    """Each GPU's other tenants' use, warm spare's slot and free memory, as the books hold them."""
    rows = GPU.objects.filter(node=node).values_list("index", "foreign_bytes", "spare_bytes", "nvml_free_bytes")
    return {index: (foreign, spare, free) for index, foreign, spare, free in rows}


def test_an_offline_node_comes_back_by_the_full_beat(box):
    Node.objects.filter(pk=box.pk).update(status=Node.Status.OFFLINE)

    nodes.heartbeat("box", **EMPTY)

    assert Node.objects.get(pk=box.pk).status == Node.Status.ONLINE
    assert Event.objects.filter(kind=Event.Kind.NODE_ONLINE, node="box", reason="heartbeat resumed").exists()


def test_a_gpu_figure_left_from_before_is_corrected_by_the_full_beat(box):
    GPU.objects.filter(node=box, index=0).update(overcommit_bytes=5)

    nodes.heartbeat("box", **EMPTY)

    assert set(GPU.objects.filter(node=box).values_list("overcommit_bytes", flat=True)) == {0}


def test_a_node_the_books_place_a_replica_on_finds_its_lost_start_by_the_full_beat(
    box, dispatched, django_capture_on_commit_callbacks
):
    spec = DeploymentSpec(name="tiny-a", source="/srv/models/tiny", replicas=1, override_bytes=300 * MiB)
    deployments.create(spec, facts=ModelFacts(weight_bytes=10 * MiB, estimate_bytes=300 * MiB))
    (replica,) = Replica.objects.filter(deployment__name="tiny-a", node=box)
    dispatched.clear()  # its start never reached the agent, which runs nothing

    with django_capture_on_commit_callbacks(execute=True):
        nodes.heartbeat("box", now=timezone.now() + timedelta(seconds=120), **EMPTY)

    assert [(t, a[:1]) for _, t, a in dispatched] == [(START, [replica.id])]


def test_an_unknown_node_is_refused_as_before():
    from scheduling.services.errors import NotFound

    with pytest.raises(NotFound):
        nodes.heartbeat("nowhere", **EMPTY)
