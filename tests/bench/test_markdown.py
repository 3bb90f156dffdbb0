"""The BENCHMARKS.md writer: only the text between a benchmark's own markers changes; everything else is kept."""

from __future__ import annotations

from hafiza.bench.markdown import Region, replace_region, table

DOC = """# Benchmarks

Intro prose that nobody generated.

## Engine core: KV cache vs recompute

Hand-written notes about the engine.
<!-- bench:cache:start -->
old table
<!-- bench:cache:end -->
More prose after the region, kept.

## Server

| measure | value |
|---|---|
| by hand | 1 |

Closing words of the server section.

## Tiered KV store

Nothing generated here yet.
"""


def test_existing_region_is_replaced_and_nothing_else() -> None:
    out = replace_region(DOC, Region("cache", "Engine core: KV cache vs recompute"), "new table")
    assert out == DOC.replace("old table", "new table")


def test_new_region_goes_at_the_end_of_its_section_keeping_the_prose() -> None:
    out = replace_region(DOC, Region("serve", "Server"), "| generated |")
    head, rest = out.split("<!-- bench:serve:start -->")
    assert head.rstrip().endswith("Closing words of the server section.")
    assert rest.startswith("\n| generated |\n<!-- bench:serve:end -->\n\n## Tiered KV store")
    assert out.replace("\n\n<!-- bench:serve:start -->\n| generated |\n<!-- bench:serve:end -->", "") == DOC


def test_regions_are_stable_when_written_again() -> None:
    serve, tiers = Region("serve", "Server"), Region("tiers", "Tiered KV store")
    once = replace_region(replace_region(DOC, serve, "a"), tiers, "b")
    twice = replace_region(replace_region(once, serve, "a"), tiers, "b")
    assert once == twice
    assert once.endswith("Nothing generated here yet.\n\n<!-- bench:tiers:start -->\nb\n<!-- bench:tiers:end -->\n")
    changed = replace_region(once, serve, "c")
    assert changed == once.replace("<!-- bench:serve:start -->\na\n", "<!-- bench:serve:start -->\nc\n")


def test_missing_section_is_appended_and_two_regions_share_a_section() -> None:
    out = replace_region(DOC, Region("llamacpp", "Peers"), "x")
    assert out == DOC + "\n## Peers\n\n<!-- bench:llamacpp:start -->\nx\n<!-- bench:llamacpp:end -->\n"
    both = replace_region(out, Region("summary", "Peers"), "y")
    assert both.startswith(out.rstrip("\n"))
    assert both.endswith("<!-- bench:llamacpp:end -->\n\n<!-- bench:summary:start -->\ny\n<!-- bench:summary:end -->\n")


def test_table_escapes_pipes() -> None:
    assert table(["a", "b"], [[1, "x|y"]]) == "| a | b |\n|---|---|\n| 1 | x\\|y |"
