"""The KV view's page: plain HTML, CSS and JavaScript shipped in the package (static/),
put together by page.py for the live server (/kv) and for replay files (`pagedllm
kv-view`), which share every line of drawing code."""
