"""The dashboard in a real browser: Playwright drives Debian's Chromium against the live
server. Screenshots go to test-artifacts/dashboard/ at the repository root (git-ignored).

Skipped, saying why, where /usr/bin/chromium is missing (.ci/run installs it with apt)."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest
from django.contrib.auth.models import User
from django.db import connection

from scheduling.models import GPU, Deployment, Occupant, Replica
from scheduling.services import reports
from tests.support.deployments import deploy

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "dashboard"
LAUNCH_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,  # Playwright's driver and the browser are processes
    pytest.mark.skipif(
        not Path(CHROMIUM).exists(), reason=f"Chromium is missing: no {CHROMIUM} (apt install chromium)"
    ),
    pytest.mark.django_db(transaction=True),  # the live server's thread must see this test's rows
]


def in_another_thread(work) -> None:
    """ORM work while Playwright's sync API runs its event loop in this thread: Django refuses
    database calls from a thread with a running loop, so they run beside it (and close their
    connection after)."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as err:  # re-raised in the test's thread
            errors.append(err)
        finally:
            connection.close()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]


def signed_in(browser, login_url: str):
    """A page 1400 px wide, signed in as the staff user `ops` through the admin's login form."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(login_url)
    page.fill("#id_username", "ops")
    page.fill("#id_password", "s3cret-pass")
    page.click("input[type=submit]")
    return page


def test_staff_sees_the_virtual_gpus_and_puts_a_replica_to_sleep_from_the_page(live_server, cluster, dispatched):
    from playwright.sync_api import expect, sync_playwright

    User.objects.create_user("ops", password="s3cret-pass", is_staff=True)
    replica_id = deploy("tiny-a")
    occupant = Occupant.objects.select_related("gpu__node").get(replica_id=replica_id)
    gpu_label = f"{occupant.gpu.node.name}/{occupant.gpu.index}"
    ARTIFACTS.mkdir(parents=True, exist_ok=True)

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=LAUNCH_ARGS)
        try:
            page = signed_in(browser, f"{live_server.url}/admin/login/?next=/admin/")
            page.click("text=GPU dashboard")  # linked from the admin index

            expect(page.locator(".gp-gpu").first).to_contain_text("virtual GPU")
            expect(page.locator(".gp-gpu")).to_have_count(4)  # the cluster's 2 nodes × 2 GPUs
            segment = page.locator(f'.gp-bar [data-replica="{replica_id}"]')
            expect(segment).to_have_attribute("data-kind", "serving")
            expect(segment).to_contain_text("tiny-a · serving · 300.00 MiB")
            expect(segment).to_have_attribute("title", "tiny-a (serving): reserved 300.00 MiB, measured 300.00 MiB")
            page.screenshot(path=str(ARTIFACTS / "1-serving.png"), full_page=True)

            page.locator(f'tr[data-replica="{replica_id}"] button[name=sleep]').click()
            expect(page.locator(".messagelist")).to_contain_text("going to sleep")
            expect(segment).to_have_attribute("data-kind", "draining")
            page.screenshot(path=str(ARTIFACTS / "2-draining.png"), full_page=True)

            # No replica process here: report what it would once its weights are in host memory.
            in_another_thread(
                lambda: reports.report(replica_id, {"event": "sleeping", "residual_bytes_by_id": {"0": 0}})
            )

            # The page's own refresh (every 3 s, no reload) shows the bar change: asleep on a virtual
            # GPU the replica holds nothing, so its segment goes and the GPU's memory is all free.
            expect(segment).to_have_count(0, timeout=15_000)
            free = page.locator(f'.gp-gpu[data-gpu="{gpu_label}"] .gp-seg-free')
            expect(free).to_have_attribute("style", "width: 100.00%")
            expect(page.locator(f'tr[data-replica="{replica_id}"] .gp-state .gp-pill')).to_have_text("sleeping")
            # Why, beside it: its latest state change's reason, not only in the events list.
            expect(page.locator(f'tr[data-replica="{replica_id}"] .gp-why-state')).to_contain_text(
                "weights moved to CPU RAM"
            )
            expect(page.locator("#gp-refreshed")).to_contain_text("Refreshed")
            page.screenshot(path=str(ARTIFACTS / "3-sleeping.png"), full_page=True)
        finally:
            browser.close()

    assert Replica.objects.get(pk=replica_id).state == "sleeping"


def test_staff_deploys_from_the_page_sees_its_colour_then_deletes_it(live_server, cluster, dispatched, tiny_model_dir):
    from playwright.sync_api import expect, sync_playwright

    from scheduling.web.dashboard import deployment_hues

    User.objects.create_user("ops", password="s3cret-pass", is_staff=True)
    deploy("tiny-a")  # another deployment beside it: two colours in the bars and the key
    ARTIFACTS.mkdir(parents=True, exist_ok=True)

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=LAUNCH_ARGS)
        try:
            page = signed_in(browser, f"{live_server.url}/admin/login/?next=/admin/dashboard/")

            page.click("#gp-deploy summary")
            form = page.locator("#gp-deploy form")
            form.locator("input[name=name]").fill("Bad Name")
            form.locator("input[name=source]").fill(str(tiny_model_dir))
            form.locator("button[type=submit]").click()
            # The API's own check, named as the API names it; the form keeps what was typed.
            expect(page.locator(".gp-deploy-errors")).to_contain_text("name: Enter a valid")
            expect(page.locator("#gp-deploy input[name=source]")).to_have_value(str(tiny_model_dir))
            page.screenshot(path=str(ARTIFACTS / "4-deploy-refused.png"), full_page=True)

            page.locator("#gp-deploy input[name=name]").fill("chat-b")
            page.locator("#gp-deploy input[name=replicas]").fill("2")
            page.locator("#gp-deploy input[name=override_mib]").fill("200")
            page.locator("#gp-deploy button[type=submit]").click()
            expect(page.locator(".messagelist")).to_contain_text("chat-b: deployed, 2 replica(s)")
            segments = page.locator('.gp-bar [data-deployment="chat-b"]')
            expect(segments).to_have_count(2)
            colour = segments.first.evaluate("el => getComputedStyle(el).backgroundColor")
            other = page.locator('.gp-bar [data-deployment="tiny-a"]').first
            assert colour != other.evaluate("el => getComputedStyle(el).backgroundColor"), "a colour of its own"
            expect(page.locator('.gp-key [data-deployment="chat-b"] .gp-swatch')).to_have_attribute(
                "style", f"background-color: hsl({deployment_hues(['chat-b', 'tiny-a'])['chat-b']} 55% 38%)"
            )
            page.screenshot(path=str(ARTIFACTS / "5-deployed.png"), full_page=True)

            page.once("dialog", lambda dialog: dialog.accept())
            page.locator('tr[data-deployment="chat-b"] button[name=delete]').click()
            expect(page.locator(".messagelist")).to_contain_text(re.compile("chat-b: deleted", re.I))
            expect(segments).to_have_count(0)
            expect(page.locator('tr[data-deployment="chat-b"]')).to_have_count(0)
            page.screenshot(path=str(ARTIFACTS / "6-deleted.png"), full_page=True)
        finally:
            browser.close()

    assert not Deployment.objects.filter(name="chat-b").exists()


# The least two deployments' colours may differ by on the page, as RGB distance (0-441): twelve
# deployments' hues land at least 20 degrees apart at the bars' saturation and lightness, about
# 32 in RGB; two names' own hues alone could land a degree apart, under 2.
MIN_RGB_APART = 25


def test_twelve_deployments_get_twelve_colours_far_enough_apart_to_tell(live_server, cluster):
    from itertools import combinations

    from playwright.sync_api import expect, sync_playwright

    from tests.support import factories as f

    User.objects.create_user("ops", password="s3cret-pass", is_staff=True)
    gpus = list(GPU.objects.select_related("node").order_by("node__name", "index"))
    names = [f"model-{i:02d}" for i in range(12)]
    for i, name in enumerate(names):
        gpu = gpus[i % len(gpus)]
        f.occupy(f.replica(f.deployment(name), gpu.node, state="serving"), gpu, 64 * 1024**2)

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=LAUNCH_ARGS)
        try:
            page = signed_in(browser, f"{live_server.url}/admin/login/?next=/admin/dashboard/")
            swatches = page.locator(".gp-key [data-deployment] .gp-swatch")
            expect(swatches).to_have_count(12)
            colours = [
                tuple(
                    int(c)
                    for c in re.findall(r"\d+", swatches.nth(i).evaluate("el => getComputedStyle(el).backgroundColor"))
                )
                for i in range(12)
            ]
            page.screenshot(path=str(ARTIFACTS / "6-twelve-colours.png"), full_page=True)
        finally:
            browser.close()

    apart = min(sum((a - b) ** 2 for a, b in zip(x, y, strict=True)) ** 0.5 for x, y in combinations(colours, 2))
    assert apart >= MIN_RGB_APART, (apart, colours)
