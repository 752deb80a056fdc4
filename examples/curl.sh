#!/usr/bin/env bash
# Talk to a running ninfer (./dev.sh serve) with curl: native, OpenAI and Anthropic routes.
set -euo pipefail
URL="${NINFER_URL:-http://127.0.0.1:8080}"
KEY=()
[ -n "${NINFER_API_KEY:-}" ] && KEY=(-H "authorization: Bearer $NINFER_API_KEY")

echo "--- native, whole response; greedy (temperature 0) wherever one answer is right"
curl -s "${KEY[@]}" "$URL/v1/generate" -H 'content-type: application/json' \
  -d '{"prompt": "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n", "temperature": 0, "max_new_tokens": 32}'
echo
echo "--- native, streamed (server-sent events); sampled (temperature 1.0), seeded"
curl -sN "${KEY[@]}" "$URL/v1/generate" -H 'content-type: application/json' \
  -d '{"prompt": "Once upon a time", "max_new_tokens": 16, "stream": true, "seed": 7}'
echo "--- OpenAI chat completions"
curl -s "${KEY[@]}" "$URL/v1/chat/completions" -H 'content-type: application/json' \
  -d '{"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "What is the capital of France?"}], "temperature": 0, "max_tokens": 32}'
echo
echo "--- Anthropic messages"
curl -s "${KEY[@]}" "$URL/v1/messages" -H 'content-type: application/json' \
  -d '{"model": "smollm2-135m-instruct", "max_tokens": 32, "temperature": 0, "messages": [{"role": "user", "content": "Say hello."}]}'
echo
echo "--- an error names the parameter at fault"
curl -s "$URL/v1/generate" -H 'content-type: application/json' -d '{"prompt": "x", "max_new_tokens": "5"}'
echo
