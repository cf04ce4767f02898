"""The dashboard's per-rank view in a real JupyterLab and Chromium: rank 1's warnings in the cell's log, and its
own output one click away. A module of its own: a JupyterLab of its own, with no other notebook's tabs."""

import pytest
from browser import lab, needs_browser, page, run_notebook, screenshot  # noqa: F401 - fixtures

SPEAKING_CELLS = ["""\
import flair_nbddp

def speaks():
    import sys, torch.distributed as dist
    if dist.get_rank() == 1:
        print("an ordinary line of rank 1")
        print("rank 1 warns on stderr", file=sys.stderr)
    dist.barrier()""", "result = flair_nbddp.launch(speaks, processes=2, device='cpu')"]


VISIBLE = "[...document.querySelectorAll('{}')].find(element => element.offsetParent !== null)"


def _visible_text(page, selector: str) -> str:
    """The text of the visible element matching ``selector`` (JupyterLab keeps other notebooks' tabs, hidden)."""
    return page.evaluate(f"() => ({VISIBLE.format(selector)} || {{innerText: ''}}).innerText")


@needs_browser
@pytest.mark.browser
def test_the_per_rank_view_switches_to_one_ranks_own_output(lab, page):
    run_notebook(page, lab, "ranks", SPEAKING_CELLS)
    page.wait_for_function(
        f"() => /finished|failed/.test(({VISIBLE.format('.nbddp-status')} || {{innerText: ''}}).innerText)",
        timeout=120_000,
    )
    assert "finished" in _visible_text(page, ".nbddp-status"), lab.log_tail()
    # one redraw sets the status, then the log: the browser may show the first before it has applied the second
    page.wait_for_function(
        f"() => ({VISIBLE.format('.nbddp-log')} || {{innerText: ''}}).innerText.includes('[rank 1] rank 1 warns')",
        timeout=10_000,
    )
    cell_view = _visible_text(page, ".nbddp-log")
    assert "[rank 1] rank 1 warns on stderr" in cell_view and "an ordinary line of rank 1" not in cell_view

    page.locator(".nbddp-rank-view button:has-text('rank 1') >> visible=true").click()
    page.wait_for_function(
        f"() => ({VISIBLE.format('.nbddp-log')} || {{innerText: ''}}).innerText.includes('an ordinary line of rank 1')",
        timeout=10_000,
    )
    rank_view = _visible_text(page, ".nbddp-log")
    assert "rank 1 on cpu" in rank_view and "rank 1 warns on stderr" in rank_view and "[rank 1]" not in rank_view
    screenshot(page, "dashboard-rank-1", ".nbddp-dashboard >> visible=true")
