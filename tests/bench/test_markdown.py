"""The BENCHMARKS.md writer: only the text between a benchmark's own markers changes; everything else is kept."""

from __future__ import annotations

from hafiza.bench.markdown import Region, replace_region, table

DOC = """# Benchmarks

Intro prose that nobody generated.

## Engine core: KV cache vs recompute (issue 2)

Hand-written notes about the engine.
<!-- bench:cache:start -->
old table
<!-- bench:cache:end -->
More prose after the region, kept.

## Server (issue 4)

| measure | value |
|---|---|
| by hand | 1 |

Closing words of the server section.

## Tiered KV store (issue 6)

Nothing generated here yet.
"""


def test_existing_region_is_replaced_and_nothing_else() -> None:
    out = replace_region(DOC, Region("cache", 2, "Engine core"), "new table")
    assert out == DOC.replace("old table", "new table")


def test_new_region_goes_at_the_end_of_its_section_keeping_the_prose() -> None:
    out = replace_region(DOC, Region("serve", 4, "Server"), "| generated |")
    head, rest = out.split("<!-- bench:serve:start -->")
    assert head.rstrip().endswith("Closing words of the server section.")
    assert rest.startswith("\n| generated |\n<!-- bench:serve:end -->\n\n## Tiered KV store (issue 6)")
    assert out.replace("\n\n<!-- bench:serve:start -->\n| generated |\n<!-- bench:serve:end -->", "") == DOC


def test_regions_are_stable_when_written_again() -> None:
    serve, tiers = Region("serve", 4, "Server"), Region("tiers", 6, "Tiers")
    once = replace_region(replace_region(DOC, serve, "a"), tiers, "b")
    twice = replace_region(replace_region(once, serve, "a"), tiers, "b")
    assert once == twice
    assert once.endswith("Nothing generated here yet.\n\n<!-- bench:tiers:start -->\nb\n<!-- bench:tiers:end -->\n")
    changed = replace_region(once, serve, "c")
    assert changed == once.replace("<!-- bench:serve:start -->\na\n", "<!-- bench:serve:start -->\nc\n")


def test_missing_section_is_appended_and_two_regions_share_a_section() -> None:
    out = replace_region(DOC, Region("llamacpp", 8, "Peers"), "x")
    assert out == DOC + "\n## Peers (issue 8)\n\n<!-- bench:llamacpp:start -->\nx\n<!-- bench:llamacpp:end -->\n"
    both = replace_region(out, Region("summary", 8, "Peers"), "y")
    assert both.startswith(out.rstrip("\n"))
    assert both.endswith("<!-- bench:llamacpp:end -->\n\n<!-- bench:summary:start -->\ny\n<!-- bench:summary:end -->\n")


def test_table_escapes_pipes() -> None:
    assert table(["a", "b"], [[1, "x|y"]]) == "| a | b |\n|---|---|\n| 1 | x\\|y |"
