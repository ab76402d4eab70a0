"""What every `pagedllm bench` result holds, for the bench tests."""

COMMON_KEYS = {
    "bench",
    "command",
    "config",
    "environment",
    "results",
    "ratios",
    "notes",
    "files",
    "table_md",
}
