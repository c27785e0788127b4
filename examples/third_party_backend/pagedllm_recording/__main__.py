"""``python -m pagedllm_recording FILE``: what a recording says, in a few lines."""

from __future__ import annotations

import json
import sys


def summarize(path: str) -> list[str]:
    events = [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]
    start = next((e for e in events if e["event"] == "start"), None)
    steps = [e for e in events if e["event"] == "step"]
    lines = []
    if start:
        lines.append(f"{start['backend']} backend, model {start['model']}: {start['num_blocks']} blocks of "
                     f"{start['block_size']} tokens, budget {start['max_num_batched_tokens']} tokens per step")
    if not steps:
        return lines + ["no steps"]
    decode_only = [s for s in steps if s["num_decodes"] == s["num_seqs"]]
    mixed = [s for s in steps if s not in decode_only]
    for kind, group in (("with prompt tokens", mixed), ("decode-only", decode_only)):
        if group:
            seconds = sum(s["seconds"] for s in group)
            tokens = sum(s["num_tokens"] for s in group)
            most = max(s["num_seqs"] for s in group)
            lines.append(f"{len(group)} steps {kind}: {tokens} tokens, {seconds:.3f} s "
                         f"({1000 * seconds / len(group):.1f} ms per step, most sequences {most})")
    most_blocks = max(len({b for row in s["block_table"] for b in row}) for s in steps)
    lines.append(f"{len(steps)} steps in all; at most {most_blocks} KV blocks in one step; "
                 f"{sum(e['event'] == 'copy_blocks' for e in events)} block copies; "
                 f"{'ended cleanly' if events[-1]['event'] == 'end' else 'no end record (the run did not shut down)'}")
    return lines


def main() -> int:
    if len(sys.argv) != 2:
        print("usage: python -m pagedllm_recording FILE.jsonl", file=sys.stderr)
        return 2
    print("\n".join(summarize(sys.argv[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
