"""`expertize inspect`'s explorer in a real headless browser (Chromium driven by Playwright): the page runs with no
JavaScript error and does what it says — tabs per layer, the unit table, a unit's detail, search, sorting, the
address of a unit — on the report of a saved tiny model (tests/test_inspect_cli.py's). `-m slow`: it needs a
Chromium (`EXPERTIZE_CHROMIUM`, else `chromium` on PATH, else Playwright's own download) and the `browser` extra;
.ci/run installs both.
"""

import json
import os
import shutil

import pytest

from tests.test_inspect_cli import _inspect, model_dir  # noqa: F401  (the saved model the report is built from)

pytestmark = pytest.mark.slow


def _chromium() -> str | None:
    """The browser to drive: EXPERTIZE_CHROMIUM, a Chromium on PATH, or None (Playwright's own `playwright install
    chromium`)."""
    named = os.environ.get("EXPERTIZE_CHROMIUM")
    if named:
        return named
    return next((path for name in ("chromium", "chromium-browser", "google-chrome") if (path := shutil.which(name))),
                None)


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as error:
        raise RuntimeError("this test drives a real browser: pip install -e '.[browser]' (Playwright), and a Chromium "
                           "(apt-get install chromium, or python -m playwright install chromium)") from error
    with sync_playwright() as playwright:
        try:
            launched = playwright.chromium.launch(executable_path=_chromium(), args=["--no-sandbox"])
        except Exception as error:  # Playwright's message names the missing browser
            raise RuntimeError(f"no Chromium to drive ({error}): apt-get install chromium, or python -m playwright "
                               "install chromium, or EXPERTIZE_CHROMIUM=/path/to/chrome") from error
        yield launched
        launched.close()


def _open(browser, url: str):
    """A page at `url` whose JavaScript errors and console errors are collected in `page.errors`."""
    page = browser.new_page()
    page.errors = []
    page.on("pageerror", lambda error: page.errors.append(f"uncaught: {error}"))
    page.on("console", lambda message: message.type == "error" and page.errors.append(f"console: {message.text}"))
    page.goto(url)
    page.wait_for_selector("#units tr[data-id]")
    return page


def _ids(page) -> list[int]:
    return [int(i) for i in page.eval_on_selector_all("#units tr[data-id]", "rows => rows.map(r => r.dataset.id)")]


def test_explorer_renders_and_responds_without_errors(browser, model_dir, tmp_path):  # noqa: F811
    out = _inspect(model_dir, tmp_path)
    reports = [json.loads((out / f"layer_{i}.json").read_text(encoding="utf-8")) for i in (0, 1)]
    page = _open(browser, (out / "index.html").as_uri())

    # Tabs: one per inspected layer, named by its kind; the first is shown.
    assert page.locator("#tabs button").all_inner_texts() == ["layer 0 · transcoder", "layer 1 · moe_x"]
    transcoder = reports[0]
    assert f"{transcoder['num_units']} latents" in page.inner_text("#summary").replace(",", "")
    assert f"{transcoder['dead_units']} dead" in page.inner_text("#summary")
    # The table lists every unit (300 < the 400 shown at once), most frequent first; dead units marked.
    ids = _ids(page)
    assert sorted(ids) == list(range(transcoder["num_units"]))
    frequency = {u["id"]: u["frequency"] for u in transcoder["units"]}
    assert [frequency[i] for i in ids] == sorted(frequency.values(), reverse=True)
    assert page.locator("#units tr.dead").count() == transcoder["dead_units"] > 0
    # The detail opens on the live unit with the highest activation, with its contexts.
    top = max((u for u in transcoder["units"] if u["frequency"] > 0), key=lambda u: u["max_activation"])
    assert f"latent {top['id']}" in page.inner_text("#detail h2")
    assert page.locator("#detail .ctx").count() == len(top["top_contexts"]) > 0

    # Clicking a dead unit shows it as dead, and the address names it.
    dead = next(u["id"] for u in transcoder["units"] if u["frequency"] == 0)
    page.click(f'#units tr[data-id="{dead}"]')
    assert f"latent {dead}" in page.inner_text("#detail h2")
    assert "never fired on the inspected tokens (dead)" in page.inner_text("#detail")
    assert page.evaluate("location.hash") == f"#L0/U{dead}"

    # Search by id keeps that unit only; sorting by id ascending orders the table.
    page.fill("#search", f"#{top['id']}")
    assert _ids(page) == [top["id"]]
    page.fill("#search", "")
    page.click('#units th[data-k="id"]')
    assert _ids(page) == list(range(transcoder["num_units"]))

    # The second tab: MoE-X's experts with its routing summary.
    page.click("#tabs button >> nth=1")
    assert "router entropy" in page.inner_text("#summary")
    assert sorted(_ids(page)) == list(range(reports[1]["num_units"]))
    assert page.errors == []

    # A unit's address opens the page on it (a link someone shares).
    shared = _open(browser, (out / "index.html").as_uri() + f"#L1/U{reports[1]['num_units'] - 1}")
    assert f"{reports[1]['unit_name']} {reports[1]['num_units'] - 1}" in shared.inner_text("#detail h2")
    assert shared.errors == []


def test_a_script_error_is_caught(browser, tmp_path):
    """The harness itself: a page whose script throws is reported (so the test above can fail)."""
    page = tmp_path / "broken.html"
    page.write_text('<table id="units"><tr data-id="0"><td>0</td></tr></table><script>undefinedName();</script>',
                    encoding="utf-8")
    opened = _open(browser, page.as_uri())
    assert opened.errors == ["uncaught: undefinedName is not defined"]
