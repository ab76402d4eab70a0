// The KV view: one script for the live page (/kv) and for replay files (pagedllm kv-view).
// It keeps a copy of the pool (the same replay rules as kv/pool_state.py), feeds it from
// the server's event stream or from a trace, and draws on canvases only when something
// changed, at most once per animation frame: a pool of thousands of blocks stays smooth.
"use strict";
(function () {
  const CONFIG = JSON.parse(document.getElementById("kv-config").textContent);
  // Each kind of event and its fields: kv/events.py's EVENT_FIELDS, which the server puts
  // in the page. A live event that the table does not describe is refused, not half drawn
  // (a replay file's events were checked against it when the file was made).
  const EVENT_FIELDS = CONFIG.events;
  function checkEvent(e) {
    const fields = Object.hasOwn(EVENT_FIELDS, e.k) ? EVENT_FIELDS[e.k] : null;
    if (!fields) throw new Error(`unknown KV event kind ${JSON.stringify(e.k)}`);
    for (const name of fields) {
      if (name !== "req" && e[name] === undefined) throw new Error(`a ${e.k} event without ${name}`);
    }
  }
  const NOISY = new Set(["append", "cache", "text"]);
  // The busy kinds the log hides unless asked: a check of proposals that gave back no
  // block is one per speculating sequence and step.
  const isNoisy = (e) => NOISY.has(e.k) || (e.k === "trim" && !e.blocks.length);
  const $ = (id) => document.getElementById(id);
  // Every node is built with textContent, never innerHTML: request ids, token text and
  // a replay file's figures are data, and data must never become markup.
  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = String(text);
    return node;
  }
  function swatch(color) {
    const i = el("i");
    i.style.background = color;
    return i;
  }

  // ------------------------------------------------------------------ the pool
  // The key of a sequence's table in layer group g (kv/events.py): its id for group 0.
  function tableKey(seq, g) {
    return g ? `${seq}/${g}` : seq;
  }

  class Pool {
    constructor(numBlocks, blockSize) {
      this.n = numBlocks;
      this.bs = blockSize;
      this.ref = new Int32Array(numBlocks);
      this.cached = new Uint8Array(numBlocks);
      this.fill = new Uint16Array(numBlocks);
      // LoRA adapters' pages: the adapter each block holds (0: none), and the pages of
      // static adapter slots (reserved for adapters from the start, reference count 1).
      this.lora = new Int32Array(numBlocks);
      this.slot = new Uint8Array(numBlocks);
      this.holders = Array.from({ length: numBlocks }, () => []); // [seq, logical index]
      this.seqs = new Map(); // seq id -> {req, blocks, tokens}
      this.text = new Map(); // block -> its tokens' text (text mode only)
      this.dirty = new Set(); // blocks whose fill must be worked out again
      this.flash = new Map(); // block -> kind, for blocks copied/forked/hit lately
      // Block -> the lookahead slots claimed in it for proposals checked lately (speculative
      // decoding), as slot indexes in the block: lo..hi were claimed, lo..kept hold kept
      // proposals; `given`: the whole block went back to the pool.
      this.lookahead = new Map();
    }

    clearFlash() {
      this.flash.clear();
      this.lookahead.clear();
    }

    static fromSnapshot(pool, text) {
      const p = new Pool(pool.num_blocks, pool.block_size);
      p.ref.set(pool.ref);
      p.cached.set(pool.cached);
      if (pool.lora) p.lora.set(pool.lora);
      if (pool.slot) p.slot.set(pool.slot);
      for (const s of pool.seqs) {
        const key = tableKey(s.seq, s.g);
        p.seqs.set(key, { req: s.req, blocks: s.blocks.slice(), tokens: s.tokens });
        s.blocks.forEach((b, i) => { if (b >= 0) p.holders[b].push([key, i]); });
      }
      for (const [b, t] of Object.entries(text || {})) p.text.set(+b, t);
      for (let b = 0; b < p.n; b++) p.dirty.add(b);
      p.settle();
      return p;
    }

    clone() {
      const p = new Pool(this.n, this.bs);
      p.ref.set(this.ref);
      p.cached.set(this.cached);
      p.fill.set(this.fill);
      p.lora.set(this.lora);
      p.slot.set(this.slot);
      p.holders = this.holders.map((h) => h.map((x) => x.slice()));
      for (const [k, s] of this.seqs) p.seqs.set(k, { req: s.req, blocks: s.blocks.slice(), tokens: s.tokens });
      p.text = new Map(this.text);
      return p;
    }

    markTokens(seq, from, to) {
      const s = this.seqs.get(seq);
      const lo = Math.floor(from / this.bs);
      const hi = Math.min(s.blocks.length, Math.ceil(to / this.bs));
      for (let i = Math.max(0, lo - 1); i < hi; i++) if (s.blocks[i] >= 0) this.dirty.add(s.blocks[i]);
    }

    unhold(block, seq) {
      const h = this.holders[block];
      const i = h.findIndex((x) => x[0] === seq);
      if (i >= 0) h.splice(i, 1);
      this.dirty.add(block);
    }

    apply(ev) {
      // A table is one sequence's in one layer group: group 0 keeps the sequence's id.
      const e = ev.seq === undefined ? ev : Object.assign({}, ev, { seq: tableKey(ev.seq, ev.g) });
      if (e.parent !== undefined) e.parent = tableKey(ev.parent, ev.g);
      switch (e.k) {
        case "alloc": {
          let s = this.seqs.get(e.seq);
          if (!s) this.seqs.set(e.seq, (s = { req: e.req, blocks: [], tokens: 0 }));
          const old = s.tokens;
          for (const b of e.blocks) {
            this.ref[b] = 1;
            this.holders[b].push([e.seq, s.blocks.length]);
            s.blocks.push(b);
            this.text.delete(b);
            this.lookahead.delete(b);
          }
          s.tokens = e.tokens;
          this.markTokens(e.seq, old, s.tokens);
          break;
        }
        case "append": {
          const s = this.seqs.get(e.seq);
          const old = s.tokens;
          s.tokens = e.tokens;
          this.markTokens(e.seq, old, s.tokens);
          break;
        }
        case "hit": {
          this.seqs.set(e.seq, { req: e.req, blocks: e.blocks.slice(), tokens: e.blocks.length * this.bs });
          e.blocks.forEach((b, i) => {
            if (b < 0) return; // the null block, behind a window
            this.ref[b] += 1;
            this.holders[b].push([e.seq, i]);
            this.dirty.add(b);
            this.flash.set(b, "hit");
          });
          break;
        }
        case "cow": {
          const s = this.seqs.get(e.seq);
          this.ref[e.src] -= 1;
          this.ref[e.dst] = 1;
          this.unhold(e.src, e.seq);
          this.holders[e.dst].push([e.seq, e.index]);
          s.blocks[e.index] = e.dst;
          if (this.text.has(e.src)) this.text.set(e.dst, this.text.get(e.src));
          this.dirty.add(e.dst);
          this.flash.set(e.dst, "cow");
          this.flash.set(e.src, "cow");
          break;
        }
        case "fork": {
          const parent = this.seqs.get(e.parent);
          this.seqs.set(e.seq, { req: e.req, blocks: parent.blocks.slice(), tokens: parent.tokens });
          parent.blocks.forEach((b, i) => {
            if (b < 0) return;
            this.ref[b] += 1;
            this.holders[b].push([e.seq, i]);
            this.flash.set(b, "fork");
          });
          break;
        }
        case "free": {
          const s = this.seqs.get(e.seq);
          if (!s) break;
          for (const b of s.blocks) {
            if (b < 0) continue;
            this.ref[b] -= 1;
            this.unhold(b, e.seq);
          }
          this.seqs.delete(e.seq);
          break;
        }
        case "drop": { // a window group gave back its blocks behind the window
          const s = this.seqs.get(e.seq);
          for (const b of e.blocks) {
            this.ref[b] -= 1;
            this.unhold(b, e.seq);
          }
          for (let i = 0; i < e.upto; i++) s.blocks[i] = -1;
          break;
        }
        case "trim": { // proposals checked: the lookahead slots of rejected ones go back
          const s = this.seqs.get(e.seq);
          const before = s.tokens;
          const first = before - e.la; // the first lookahead slot
          const gone = s.blocks.splice(s.blocks.length - e.blocks.length, e.blocks.length);
          const all = s.blocks.concat(gone);
          for (let i = Math.max(0, Math.floor(first / this.bs)); i < all.length; i++) {
            const at = i * this.bs;
            const lo = Math.max(0, first - at);
            const hi = Math.min(this.bs, before - at);
            if (all[i] < 0 || hi <= lo) continue;
            const kept = Math.max(lo, Math.min(hi, e.tokens - at));
            this.lookahead.set(all[i], { lo, kept, hi, req: s.req, given: i >= s.blocks.length });
          }
          for (const b of gone) {
            this.ref[b] -= 1;
            this.unhold(b, e.seq);
            this.text.delete(b);
          }
          s.tokens = e.tokens;
          this.markTokens(e.seq, e.tokens, before);
          break;
        }
        case "cache": this.cached[e.block] = 1; break;
        case "evict": this.cached[e.block] = 0; this.text.delete(e.block); break;
        case "reset": this.cached.fill(0); break;
        case "text": this.text.set(e.block, e.text); break;
        case "lora_load": {
          for (const b of e.blocks) {
            this.ref[b] = 1;
            this.lora[b] = e.lora;
            this.flash.set(b, "lora");
          }
          break;
        }
        case "lora_evict": {
          for (const b of e.blocks) {
            this.ref[b] = this.slot[b];
            this.lora[b] = 0;
          }
          break;
        }
        default: break; // notes: preempt, finish, abort
      }
    }

    // Fill of the blocks touched since the last call: the most any holder claimed there.
    settle() {
      const bs = this.bs;
      for (const b of this.dirty) {
        let f = 0;
        for (const [seq, i] of this.holders[b]) {
          const s = this.seqs.get(seq);
          if (s) f = Math.max(f, Math.min(bs, Math.max(0, s.tokens - i * bs)));
        }
        this.fill[b] = f;
      }
      this.dirty.clear();
    }

    requests() {
      const reqs = new Map();
      for (const [seq, s] of this.seqs) {
        const key = s.req == null ? "seq " + seq : s.req;
        let r = reqs.get(key);
        if (!r) reqs.set(key, (r = { id: key, seqs: [], blocks: new Set(), tokens: 0 }));
        r.seqs.push(seq);
        s.blocks.forEach((b) => { if (b >= 0) r.blocks.add(b); });
        r.tokens = Math.max(r.tokens, s.tokens);
      }
      return reqs;
    }

    ownerOf(block) {
      const reqs = [];
      for (const [seq] of this.holders[block]) {
        const s = this.seqs.get(seq);
        const r = s && s.req != null ? s.req : "seq " + seq;
        if (!reqs.includes(r)) reqs.push(r);
      }
      return reqs;
    }
  }

  // ------------------------------------------------------------------ colours
  const hueCache = new Map();
  function hue(req) {
    let h = hueCache.get(req);
    if (h === undefined) {
      let x = 2166136261;
      for (let i = 0; i < req.length; i++) x = Math.imul(x ^ req.charCodeAt(i), 16777619);
      // Any hue but the teal band, which marks cached blocks.
      h = ((x >>> 0) * 137.508) % 310;
      if (h >= 150) h += 50;
      hueCache.set(req, h);
    }
    return h;
  }
  const col = (req, light, alpha) =>
    `hsla(${hue(req).toFixed(0)}, 70%, ${light}%, ${alpha === undefined ? 1 : alpha})`;
  const FLASH = { cow: "#f5c451", fork: "#d2a8ff", hit: "#3fd0c0", lora: "#ff9e3d" };
  // LoRA adapters' pages: dark amber under an amber band, whatever the requests' hues.
  const LORA = { page: "#7a4a12", band: "#ff9e3d", slot: "#3a2c12" };
  const short = (id) => (id.length > 14 ? "…" + id.slice(-10) : id);

  // Diagonal lines over a rectangle: the mark of lookahead slots.
  function hatch(ctx, x, y, w, h, color) {
    if (w <= 0 || h <= 0) return;
    ctx.save();
    ctx.beginPath();
    ctx.rect(x, y, w, h);
    ctx.clip();
    ctx.strokeStyle = color;
    ctx.lineWidth = 1;
    ctx.beginPath();
    for (let d = -h; d < w; d += 4) {
      ctx.moveTo(x + d, y + h);
      ctx.lineTo(x + d + h, y);
    }
    ctx.stroke();
    ctx.restore();
  }

  // A grid cell's lookahead slots (slots fill a cell bottom up): the kept proposals'
  // slots hatched in white, the rejected ones' hatched and outlined with a dashed line in
  // the request's colour, a whole block given back outlined dashed.
  function drawLookahead(ctx, x, y, sz, la, bs) {
    const top = (slot) => y + sz - (sz * slot) / bs;
    const req = String(la.req ?? "?");
    hatch(ctx, x, top(la.kept), sz, top(la.lo) - top(la.kept), "rgba(255, 255, 255, 0.8)");
    const h = top(la.kept) - top(la.hi);
    ctx.setLineDash([2, 2]);
    ctx.strokeStyle = col(req, 70);
    ctx.lineWidth = 1;
    if (h > 0) {
      hatch(ctx, x, top(la.hi), sz, h, col(req, 58, 0.7));
      ctx.strokeRect(x + 0.5, top(la.hi) + 0.5, sz - 1, h - 1);
    }
    if (la.given) ctx.strokeRect(x + 1.5, y + 1.5, sz - 3, sz - 3);
    ctx.setLineDash([]);
  }

  // ------------------------------------------------------------------ the view
  const view = {
    pool: null,
    st: null,
    step: 0,
    selected: null, // request id
    userPicked: false,
    hover: -1,
    log: [], // newest last: [step, event]
    series: [], // [step, util, used fraction, running, waiting, preemptions]
    cursorStep: null, // replay: the step shown on the chart
    counts: {},
    dirty: true,
    reqsDue: 0,
  };
  let gridLayout = null;

  function resizeCanvas(canvas, height) {
    const dpr = window.devicePixelRatio || 1;
    const w = canvas.parentElement.clientWidth;
    if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(height * dpr)) {
      canvas.width = Math.round(w * dpr);
      canvas.height = Math.round(height * dpr);
      canvas.style.height = height + "px";
    }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    return [ctx, w];
  }

  function drawGrid() {
    const pool = view.pool;
    const canvas = $("grid");
    const width = canvas.parentElement.clientWidth;
    // The largest cell that fits the pool in about 470 px of height.
    let cell = 30;
    while (cell > 5 && Math.ceil(pool.n / Math.floor(width / cell)) * cell > 470) cell--;
    const cols = Math.floor(width / cell);
    const rows = Math.ceil(pool.n / cols);
    const [ctx] = resizeCanvas(canvas, rows * cell);
    gridLayout = { cell, cols };
    ctx.clearRect(0, 0, width, rows * cell);
    const gap = cell >= 10 ? 2 : 1;
    const sz = cell - gap;
    const sel = view.selected;
    let used = 0;
    let adapterPages = 0;
    ctx.font = `600 ${Math.max(8, Math.floor(sz * 0.55))}px ui-monospace, monospace`;
    ctx.textAlign = "center";
    ctx.textBaseline = "middle";
    for (let b = 0; b < pool.n; b++) {
      const x = (b % cols) * cell;
      const y = Math.floor(b / cols) * cell;
      const ref = pool.ref[b];
      const owners = ref > 0 ? pool.ownerOf(b) : [];
      const mine = sel !== null && owners.includes(sel);
      ctx.globalAlpha = sel !== null && !mine ? 0.5 : 1;
      if (pool.lora[b] || pool.slot[b]) {
        // An adapter's page (an amber band on top, its id when there is room), or an
        // empty page of a static adapter slot.
        adapterPages++;
        ctx.fillStyle = pool.lora[b] ? LORA.page : LORA.slot;
        ctx.fillRect(x, y, sz, sz);
        if (pool.lora[b]) {
          ctx.fillStyle = LORA.band;
          ctx.fillRect(x, y, sz, Math.max(2, Math.round(sz * 0.25)));
          if (sz >= 13) ctx.fillText(String(pool.lora[b]), x + sz / 2, y + sz * 0.62);
        }
      } else if (ref === 0) {
        ctx.fillStyle = pool.cached[b] ? "#1f5a5a" : "#1d232d";
        ctx.fillRect(x, y, sz, sz);
        if (pool.cached[b] && sz >= 8) {
          ctx.fillStyle = "#3fd0c0";
          ctx.fillRect(x + sz / 2 - 1, y + sz / 2 - 1, 2, 2);
        }
      } else {
        used++;
        const req = owners[0] || "?";
        const f = pool.fill[b] / pool.bs;
        ctx.fillStyle = col(req, 24);
        ctx.fillRect(x, y, sz, sz);
        const h = Math.round(sz * f);
        ctx.fillStyle = col(req, 58);
        ctx.fillRect(x, y + sz - h, sz, h);
        if (owners.length > 1) {
          // Shared across requests (a prefix-cache hit): the second owner's colour too.
          ctx.fillStyle = col(owners[1], 58);
          ctx.beginPath();
          ctx.moveTo(x + sz, y + sz * 0.45);
          ctx.lineTo(x + sz, y + sz);
          ctx.lineTo(x + sz * 0.45, y + sz);
          ctx.fill();
        }
        if (pool.cached[b]) {
          ctx.fillStyle = "#3fd0c0";
          ctx.beginPath();
          const c = Math.max(3, sz * 0.32);
          ctx.moveTo(x + sz - c, y);
          ctx.lineTo(x + sz, y);
          ctx.lineTo(x + sz, y + c);
          ctx.fill();
        }
        if (ref > 1) {
          ctx.strokeStyle = "#ffffff";
          ctx.lineWidth = 1;
          ctx.strokeRect(x + 0.5, y + 0.5, sz - 1, sz - 1);
          if (sz >= 13) {
            ctx.fillStyle = "#0d1117";
            ctx.fillText(String(ref), x + sz / 2 + 1, y + sz / 2 + 1);
            ctx.fillStyle = "#ffffff";
            ctx.fillText(String(ref), x + sz / 2, y + sz / 2);
          }
        }
      }
      const la = pool.lookahead.get(b);
      if (la) drawLookahead(ctx, x, y, sz, la, pool.bs);
      const flash = pool.flash.get(b);
      if (flash || mine || b === view.hover) {
        ctx.globalAlpha = 1;
        ctx.strokeStyle = b === view.hover ? "#ffffff" : flash ? FLASH[flash] : "#e6edf3";
        ctx.lineWidth = flash ? 2 : 1;
        ctx.strokeRect(x + 1, y + 1, sz - 2, sz - 2);
      }
    }
    ctx.globalAlpha = 1;
    document.body.dataset.drawnBlocks = String(pool.n);
    document.body.dataset.usedBlocks = String(used);
    document.body.dataset.adapterBlocks = String(adapterPages); // adapters' pages and slots
    // Blocks drawn with lookahead slots, and those of them given back (for tests).
    document.body.dataset.lookaheadBlocks = String(pool.lookahead.size);
    document.body.dataset.givenBlocks = String([...pool.lookahead.values()].filter((l) => l.given).length);
    $("poolinfo").textContent = `${pool.n} blocks × ${pool.bs} tokens`;
  }

  function drawTable() {
    const pool = view.pool;
    const canvas = $("table");
    const sel = view.selected;
    const seqs = [];
    for (const [id, s] of pool.seqs) if (s.req === sel) seqs.push([id, s]);
    const order = (k) => parseFloat(String(k).replace("/", ".")); // "3/1": seq 3, group 1
    seqs.sort((a, b) => order(a[0]) - order(b[0]));
    const width = canvas.parentElement.clientWidth;
    const rowH = 30;
    const height = seqs.length ? 28 + seqs.length * rowH + 86 + 56 : 60;
    const [ctx] = resizeCanvas(canvas, height);
    ctx.clearRect(0, 0, width, height);
    ctx.font = "11px ui-monospace, monospace";
    ctx.textBaseline = "middle";
    if (!seqs.length) {
      ctx.fillStyle = "#8b95a5";
      ctx.fillText(sel === null ? "no request selected" : `request ${short(sel)} holds no blocks now`, 8, 30);
      document.body.dataset.tableArrows = "0";
      $("tableinfo").textContent = sel === null ? "click a block or a request" : short(sel);
      $("seqtext").replaceChildren();
      return;
    }
    const left = 78;
    const avail = width - left - 8;
    const maxLen = Math.max(...seqs.map(([, s]) => s.blocks.length));
    const bw = Math.max(3, Math.min(46, avail / maxLen));
    const phys = [...new Set(seqs.flatMap(([, s]) => s.blocks.filter((b) => b >= 0)))].sort((a, b) => a - b);
    const pw = Math.max(3, Math.min(46, avail / phys.length));
    const physY = 28 + seqs.length * rowH + 86;
    const physX = new Map(phys.map((b, i) => [b, left + i * pw]));
    ctx.fillStyle = "#8b95a5";
    ctx.fillText("logical", 8, 14);
    ctx.fillText("physical", 8, physY + 11);
    let arrows = 0;
    // Arrows first, under the boxes: logical block i of each sequence -> its physical block.
    seqs.forEach(([, s], r) => {
      const y0 = 28 + r * rowH + 22;
      // Each sequence's arrows in a hue of its own, near its request's.
      ctx.strokeStyle = `hsla(${(hue(sel) + r * 41) % 360}, 75%, 66%, 0.6)`;
      ctx.lineWidth = 1.2;
      s.blocks.forEach((b, i) => {
        if (b < 0) return; // behind a window: no block
        const x0 = left + i * bw + bw / 2;
        const x1 = physX.get(b) + pw / 2;
        ctx.beginPath();
        ctx.moveTo(x0, y0);
        ctx.bezierCurveTo(x0, y0 + 50, x1, physY - 50, x1, physY);
        ctx.stroke();
        arrows++;
      });
    });
    seqs.forEach(([id, s], r) => {
      const y = 28 + r * rowH;
      ctx.fillStyle = "#d8dee9";
      ctx.fillText(`seq ${id}`, 8, y + 11);
      s.blocks.forEach((b, i) => {
        if (b < 0) return;
        const x = left + i * bw;
        const f = Math.min(pool.bs, Math.max(0, s.tokens - i * pool.bs)) / pool.bs;
        ctx.fillStyle = col(sel, 22);
        ctx.fillRect(x, y, bw - 2, 22);
        ctx.fillStyle = col(sel, 55);
        ctx.fillRect(x, y, (bw - 2) * f, 22);
        const la = pool.lookahead.get(b);
        if (la) { // lookahead slots of kept proposals (the rejected ones' slots are gone)
          const w = (bw - 2) / pool.bs;
          hatch(ctx, x + la.lo * w, y, (la.kept - la.lo) * w, 22, "rgba(255, 255, 255, 0.8)");
        }
        if (bw >= 24) {
          ctx.fillStyle = "#0d1117";
          ctx.fillText(String(i), x + 4, y + 11);
        }
      });
    });
    phys.forEach((b) => {
      const x = physX.get(b);
      const shared = pool.ref[b] > 1;
      ctx.fillStyle = col(pool.ownerOf(b)[0] || sel, 24);
      ctx.fillRect(x, physY, pw - 2, 22);
      ctx.fillStyle = col(pool.ownerOf(b)[0] || sel, 55);
      ctx.fillRect(x, physY, (pw - 2) * (pool.fill[b] / pool.bs), 22);
      if (shared) {
        ctx.strokeStyle = "#ffffff";
        ctx.strokeRect(x + 0.5, physY + 0.5, pw - 3, 21);
      }
      const flash = pool.flash.get(b);
      if (flash) {
        ctx.strokeStyle = FLASH[flash];
        ctx.lineWidth = 2;
        ctx.strokeRect(x + 1, physY + 1, pw - 4, 20);
        ctx.lineWidth = 1;
      }
      if (pw >= 26) {
        ctx.fillStyle = "#e6edf3";
        ctx.textAlign = "center";
        ctx.fillText(String(b), x + (pw - 2) / 2, physY + 34);
        if (shared) ctx.fillText("×" + pool.ref[b], x + (pw - 2) / 2, physY + 48);
        ctx.textAlign = "left";
      }
    });
    document.body.dataset.tableArrows = String(arrows);
    const shared = phys.filter((b) => pool.ref[b] > 1).length;
    $("tableinfo").textContent =
      `${short(sel)}: ${seqs.length} sequence${seqs.length > 1 ? "s" : ""}, ` +
      `${phys.length} physical blocks for ${seqs.reduce((a, [, s]) => a + s.blocks.length, 0)} ` +
      `logical (${shared} shared)`;
    drawSeqText(seqs);
  }

  function drawSeqText(seqs) {
    const pool = view.pool;
    const box = $("seqtext");
    box.replaceChildren();
    if (!pool.text.size) return;
    for (const [id, s] of seqs) {
      const row = document.createElement("div");
      row.className = "row";
      row.textContent = `seq ${id}: `;
      s.blocks.forEach((b, i) => {
        const span = document.createElement("span");
        span.className = "blk";
        span.style.background = col(s.req || "?", i % 2 ? 20 : 27);
        span.title = `logical ${i} -> block ${b}`;
        // One line per sequence: newlines and tabs shown as symbols.
        span.textContent = (pool.text.get(b) || "·").replace(/\n/g, "⏎").replace(/\t/g, "⇥");
        row.appendChild(span);
      });
      box.appendChild(row);
    }
  }

  const SERIES = [
    ["KV utilisation", "#56d364", (p) => p[1], "pct"],
    ["blocks used", "#58a6ff", (p) => p[2], "pct"],
    ["running", "#f0883e", (p) => p[3], "n"],
    ["waiting", "#d2a8ff", (p) => p[4], "n"],
  ];

  function drawChart() {
    const canvas = $("chart");
    const height = 170;
    const [ctx, width] = resizeCanvas(canvas, height);
    ctx.clearRect(0, 0, width, height);
    const pts = view.series;
    const l = 36;
    const r = 36;
    const t = 8;
    const b = 18;
    const w = width - l - r;
    const h = height - t - b;
    ctx.strokeStyle = "#262e3a";
    ctx.fillStyle = "#8b95a5";
    ctx.font = "10px ui-monospace, monospace";
    ctx.lineWidth = 1;
    let nmax = 4;
    for (const p of pts) nmax = Math.max(nmax, p[3], p[4]);
    nmax = Math.ceil(nmax / 4) * 4; // whole numbers on the right axis
    for (let i = 0; i <= 4; i++) {
      const y = t + h - (h * i) / 4;
      ctx.beginPath();
      ctx.moveTo(l, y);
      ctx.lineTo(l + w, y);
      ctx.stroke();
      ctx.textAlign = "right";
      ctx.fillText(`${i * 25}%`, l - 4, y);
      ctx.textAlign = "left";
      ctx.fillText(String((nmax * i) / 4), l + w + 4, y);
    }
    // The legend gives the values at the step shown (the replay's cursor, or the latest).
    let at = pts.length - 1;
    if (view.cursorStep !== null) while (at > 0 && pts[at][0] > view.cursorStep) at--;
    const legend = SERIES.map(([name, color, get, kind]) => {
      const last = at >= 0 ? get(pts[at]) : 0;
      const v = kind === "pct" ? (100 * last).toFixed(1) + "%" : String(last);
      return [color, `${name} ${v}`];
    });
    legend.push(["#ff7b72", `preemptions ${at >= 0 ? pts[at][5] : 0}`]);
    $("chartlegend").replaceChildren(
      ...legend.map(([color, text]) => {
        const span = el("span");
        span.append(swatch(color), text);
        return span;
      }),
    );
    if (pts.length < 2) return;
    const s0 = pts[0][0];
    const span = Math.max(1, pts[pts.length - 1][0] - s0);
    const X = (s) => l + (w * (s - s0)) / span;
    ctx.fillStyle = "#8b95a5";
    ctx.textAlign = "left";
    ctx.fillText(`step ${s0}`, l, t + h + 11);
    ctx.textAlign = "right";
    ctx.fillText(`step ${pts[pts.length - 1][0]}`, l + w, t + h + 11);
    const every = Math.max(1, Math.floor(pts.length / (2 * w)));
    // Preemptions: a red tick where the count went up.
    ctx.strokeStyle = "#ff7b72";
    for (let i = 1; i < pts.length; i++) {
      if (pts[i][5] > pts[i - 1][5]) {
        const x = X(pts[i][0]);
        ctx.beginPath();
        ctx.moveTo(x, t + h);
        ctx.lineTo(x, t + h - 10);
        ctx.stroke();
      }
    }
    for (const [, color, get, kind] of SERIES) {
      ctx.strokeStyle = color;
      ctx.lineWidth = 1.5;
      ctx.beginPath();
      for (let i = 0; i < pts.length; i += every) {
        const v = get(pts[i]);
        const y = t + h - h * (kind === "pct" ? v : v / nmax);
        if (i === 0) ctx.moveTo(X(pts[i][0]), y);
        else ctx.lineTo(X(pts[i][0]), y);
      }
      ctx.stroke();
    }
    if (view.cursorStep !== null) {
      const x = X(view.cursorStep);
      ctx.strokeStyle = "#f5c451";
      ctx.setLineDash([3, 3]);
      ctx.beginPath();
      ctx.moveTo(x, t);
      ctx.lineTo(x, t + h);
      ctx.stroke();
      ctx.setLineDash([]);
    }
  }

  function describe(e) {
    const who = e.req != null ? ` (${short(String(e.req))})` : "";
    switch (e.k) {
      case "alloc": return `seq ${e.seq}${who} +${e.blocks.length} [${e.blocks.slice(0, 8).join(",")}${e.blocks.length > 8 ? ",…" : ""}] → ${e.tokens} slots`;
      case "append": return `seq ${e.seq}${who} → ${e.tokens} slots`;
      case "hit": return `seq ${e.seq}${who} reuses cached [${e.blocks.slice(0, 8).join(",")}${e.blocks.length > 8 ? ",…" : ""}]`;
      case "cow": return `seq ${e.seq}${who} copies block ${e.src} → ${e.dst} (logical ${e.index})`;
      case "fork": return `seq ${e.seq} ← seq ${e.parent}${who} shares its blocks`;
      case "free": return `seq ${e.seq}${who} frees ${e.blocks.length} block${e.blocks.length === 1 ? "" : "s"}`;
      case "trim": return `seq ${e.seq}${who} checked ${e.la} proposal${e.la === 1 ? "" : "s"} → ${e.tokens} slots${e.blocks.length ? `, gave back [${e.blocks.join(",")}]` : ""}`;
      case "drop": return `seq ${e.seq}${who} gives back [${e.blocks.join(",")}] behind its window`;
      case "cache": return `block ${e.block} joins the prefix cache`;
      case "evict": return `block ${e.block} evicted from the prefix cache`;
      case "reset": return "prefix cache reset";
      case "text": return `block ${e.block}: ${JSON.stringify(e.text)}`;
      case "lora_load": return `adapter ${e.lora} loaded into [${e.blocks.slice(0, 8).join(",")}${e.blocks.length > 8 ? ",…" : ""}]`;
      case "lora_evict": return `adapter ${e.lora} leaves ${e.blocks.length} page${e.blocks.length === 1 ? "" : "s"}`;
      default: return String(e.req);
    }
  }

  function drawLog() {
    const noisy = $("noisy").checked;
    const rows = [];
    for (let i = view.log.length - 1; i >= 0 && rows.length < 250; i--) {
      const [step, e] = view.log[i];
      if (!noisy && isNoisy(e)) continue;
      const row = el("div", "ev");
      row.append(el("span", "s", step), el("span", `k k-${e.k}`, e.k), el("span", "t", describe(e)));
      rows.push(row);
    }
    $("log").replaceChildren(...rows);
  }

  function drawRequests() {
    const reqs = [...view.pool.requests().values()];
    reqs.sort((a, b) => b.blocks.size - a.blocks.size || (a.id < b.id ? -1 : 1));
    if (view.selected !== null && !reqs.some((r) => r.id === view.selected)) view.userPicked = false;
    if (!view.userPicked) {
      // Show the request that shares the most: most sequences, then most blocks.
      const best = reqs.slice().sort((a, b) => b.seqs.length - a.seqs.length || b.blocks.size - a.blocks.size)[0];
      view.selected = best ? best.id : null;
    }
    const head = el("div", "req reqhead");
    head.append(el("span"), el("span", "", "request"), el("span", "n", "seqs"));
    head.append(el("span", "n", "blocks"), el("span", "n", "tokens"));
    const rows = [head];
    for (const r of reqs.slice(0, 300)) {
      const row = el("div", r.id === view.selected ? "req sel" : "req");
      row.dataset.req = r.id;
      const dot = el("span", "dot");
      dot.style.background = col(r.id, 58);
      const id = el("span", "id", short(r.id));
      id.title = r.id;
      row.append(dot, id, el("span", "n", r.seqs.length), el("span", "n", r.blocks.size));
      row.append(el("span", "n", r.tokens));
      rows.push(row);
    }
    $("reqlist").replaceChildren(...rows);
    const st = view.st || {};
    $("reqinfo").textContent = `${reqs.length} holding blocks · ${st.wait || 0} waiting`;
  }

  function drawStats() {
    const st = view.st;
    const pool = view.pool;
    if (!st) return;
    // LoRA adapters' pages (static slots' included): in use, but not KV blocks (`used`).
    let adapterPages = 0;
    for (let b = 0; b < pool.n; b++) if (pool.lora[b] || pool.slot[b]) adapterPages++;
    const items = [
      [view.step, "step"],
      [`${st.used}/${pool.n}`, "blocks used"],
      ...(adapterPages ? [[adapterPages, "adapter pages"]] : []),
      [pool.n - st.used - adapterPages, "free"],
      [st.cached, "cached"],
      [st.shared, "shared"],
      [st.tokens, "tokens stored"],
      [(100 * st.util).toFixed(1) + "%", "utilisation"],
      [st.run, "running"],
      [st.wait, "waiting"],
      [st.pre, "preemptions"],
    ];
    $("stats").replaceChildren(
      ...items.map(([v, k]) => {
        const stat = el("div", "stat");
        stat.append(el("b", "", v), el("span", "", k));
        return stat;
      }),
    );
    document.body.dataset.step = String(view.step);
  }

  function frame() {
    requestAnimationFrame(frame);
    if (!view.dirty || !view.pool) return;
    view.dirty = false;
    const now = performance.now();
    if (now >= view.reqsDue) {
      // The request list is DOM: rebuilt a few times a second at most.
      drawRequests();
      view.reqsDue = now + 250;
    }
    drawStats();
    drawGrid();
    drawTable();
    drawChart();
    drawLog();
    document.body.dataset.counts = JSON.stringify(view.counts);
    document.body.dataset.drawn = String(Number(document.body.dataset.drawn || 0) + 1);
  }

  // ------------------------------------------------------------------ feeding the view
  function point(step, st) {
    return [step, st.util, st.used / view.pool.n, st.run, st.wait, st.pre];
  }

  function countEvent(counts, e) {
    counts[e.k] = (counts[e.k] || 0) + 1;
  }

  function applyRecord(rec, keepLog) {
    for (const e of rec.ev) {
      view.pool.apply(e);
      countEvent(view.counts, e);
      if (keepLog) view.log.push([rec.step, e]);
    }
    view.step = rec.step;
    view.st = rec.st;
  }

  function trimLog() {
    if (view.log.length > 3000) view.log.splice(0, view.log.length - 2000);
  }

  // ------------------------------------------------------------------ live
  const KEY = "pagedllm-kv-key";
  const base = location.pathname.replace(/\/kv\/?$/, "/");

  function status(text, cls) {
    const s = $("status");
    s.textContent = text;
    s.className = "status " + (cls || "");
  }

  function liveSnapshot(msg) {
    view.pool = Pool.fromSnapshot(msg.pool, msg.text);
    view.step = msg.step;
    view.st = msg.st;
    // A snapshot stands in for the steps it coalesced: their notable events count as seen.
    for (const rec of msg.log || []) {
      for (const e of rec.ev) {
        view.log.push([rec.step, e]);
        countEvent(view.counts, e);
      }
    }
    if (msg.series) for (const [step, st] of msg.series) view.series.push(point(step, st));
    view.series.push(point(msg.step, msg.st));
    trimLog();
    view.dirty = true;
  }

  function liveUpdate(msg) {
    try {
      for (const rec of msg.records) rec.ev.forEach(checkEvent);
    } catch (err) {
      status(`${err.message}: update not drawn`, "bad");
      return;
    }
    view.pool.clearFlash();
    for (const rec of msg.records) {
      applyRecord(rec, true);
      view.series.push(point(rec.step, rec.st));
    }
    view.pool.settle();
    if (view.series.length > 1500) view.series.splice(0, view.series.length - 1200);
    trimLog();
    view.dirty = true;
  }

  async function connectLive() {
    const fromHash = new URLSearchParams(location.hash.slice(1)).get("key");
    if (fromHash) {
      sessionStorage.setItem(KEY, fromHash);
      history.replaceState(null, "", location.pathname + location.search);
    }
    const key = sessionStorage.getItem(KEY);
    let token;
    try {
      const r = await fetch(base + "kv/token", {
        method: "POST",
        headers: key ? { Authorization: "Bearer " + key } : {},
      });
      if (r.status === 401) {
        askKey(key ? "That key was refused." : "");
        return;
      }
      if (!r.ok) throw new Error("HTTP " + r.status);
      token = (await r.json()).token;
    } catch (err) {
      status("server unreachable; retrying", "bad");
      setTimeout(connectLive, 2000);
      return;
    }
    $("keybox").hidden = true;
    const url = base + "kv/events" + (token ? "?token=" + encodeURIComponent(token) : "");
    const source = new EventSource(url);
    source.addEventListener("snapshot", (e) => {
      liveSnapshot(JSON.parse(e.data));
      status("live", "live");
    });
    source.addEventListener("update", (e) => liveUpdate(JSON.parse(e.data)));
    source.addEventListener("bye", () => {
      // The server ends each stream after a while; a new one starts from a snapshot.
      source.close();
      connectLive();
    });
    source.onerror = () => {
      // A restarted server or an expired token: start over with a fresh token.
      source.close();
      status("reconnecting…", "bad");
      setTimeout(connectLive, 1500);
    };
  }

  function askKey(error) {
    sessionStorage.removeItem(KEY);
    $("keyerror").textContent = error;
    $("keybox").hidden = false;
    $("keyinput").focus();
    status("API key needed", "bad");
  }

  $("keyform").addEventListener("submit", (e) => {
    e.preventDefault();
    sessionStorage.setItem(KEY, $("keyinput").value);
    $("keyinput").value = "";
    connectLive();
  });

  // ------------------------------------------------------------------ replay
  function startReplay(trace) {
    const records = trace.records;
    const K = 64; // a stored copy of the pool every K records, to seek fast
    const start = Pool.fromSnapshot(trace.start.pool, trace.start.text);
    const frames = [start.clone()];
    const cum = []; // running counts of each kind, per record
    const counts = {};
    let p = start;
    view.pool = p;
    records.forEach((rec, i) => {
      for (const e of rec.ev) {
        p.apply(e);
        countEvent(counts, e);
      }
      cum.push(Object.assign({}, counts));
      view.series.push(point(rec.step, rec.st));
      if ((i + 1) % K === 0) {
        p.settle();
        p.clearFlash();
        frames.push(p.clone());
      }
    });
    let pos = 0; // records applied
    function seek(n) {
      n = Math.max(0, Math.min(records.length, n));
      const f = Math.floor(n / K);
      const pool = frames[f].clone();
      for (let i = f * K; i < n; i++) {
        if (i === n - 1) pool.clearFlash();
        for (const e of records[i].ev) pool.apply(e);
      }
      pool.settle();
      view.pool = pool;
      pos = n;
      const rec = n > 0 ? records[n - 1] : null;
      view.step = rec ? rec.step : trace.start.step;
      view.st = rec ? rec.st : trace.start.st;
      view.cursorStep = view.step;
      view.counts = n > 0 ? cum[n - 1] : {};
      // The log: the latest events up to here.
      view.log = [];
      for (let i = n - 1; i >= 0 && view.log.length < 400; i--) {
        const ev = records[i].ev;
        for (let j = ev.length - 1; j >= 0; j--) view.log.push([records[i].step, ev[j]]);
      }
      view.log.reverse();
      $("slider").value = String(n);
      $("steplabel").textContent = `step ${view.step} · ${n}/${records.length}`;
      view.dirty = true;
    }
    $("replay-bar").hidden = false;
    $("slider").max = String(records.length);
    $("slider").addEventListener("input", () => seek(+$("slider").value));
    $("back").addEventListener("click", () => seek(pos - 1));
    $("fwd").addEventListener("click", () => seek(pos + 1));
    let playing = false;
    let last = 0;
    let acc = 0;
    function tick(t) {
      if (!playing) return;
      acc += ((t - last) / 1000) * +$("speed").value;
      last = t;
      if (acc >= 1) {
        const n = Math.floor(acc);
        acc -= n;
        if (pos + n >= records.length) {
          seek(records.length);
          toggle(false);
          return;
        }
        seek(pos + n);
      }
      requestAnimationFrame(tick);
    }
    function toggle(on) {
      playing = on;
      $("play").textContent = on ? "❚❚" : "▶";
      if (on) {
        if (pos >= records.length) seek(0);
        last = performance.now();
        acc = 0;
        requestAnimationFrame(tick);
      }
    }
    $("play").addEventListener("click", () => toggle(!playing));
    document.addEventListener("keydown", (e) => {
      if (e.target.tagName === "INPUT" && e.target.type !== "range") return;
      if (e.key === " ") { e.preventDefault(); toggle(!playing); }
      if (e.key === "ArrowLeft") seek(pos - 1);
      if (e.key === "ArrowRight") seek(pos + 1);
    });
    const meta = trace.meta || {};
    $("subtitle").textContent = "replay" + (meta.command ? " of: " + meta.command : "");
    status(`${records.length} steps recorded`, "live");
    // Open at the last step where the most sequences ran at once (forks, copies and
    // shared blocks show best), or at #step=N.
    const wanted = new URLSearchParams(location.hash.slice(1)).get("step");
    let at = records.length;
    if (wanted !== null) {
      at = records.findIndex((r) => r.step >= +wanted) + 1 || records.length;
    } else if (records.length) {
      let best = -1;
      records.forEach((r, i) => {
        if (r.st.seqs >= best && r.st.seqs > 0) { best = r.st.seqs; at = i + 1; }
      });
    }
    seek(at);
  }

  // ------------------------------------------------------------------ interaction
  function blockAt(ev) {
    if (!gridLayout || !view.pool) return -1;
    const rect = $("grid").getBoundingClientRect();
    const x = ev.clientX - rect.left;
    const y = ev.clientY - rect.top;
    const b = Math.floor(y / gridLayout.cell) * gridLayout.cols + Math.floor(x / gridLayout.cell);
    return x >= 0 && x < gridLayout.cols * gridLayout.cell && b >= 0 && b < view.pool.n ? b : -1;
  }

  $("grid").addEventListener("mousemove", (ev) => {
    const b = blockAt(ev);
    const tip = $("tip");
    if (b !== view.hover) {
      view.hover = b;
      view.dirty = true;
    }
    if (b < 0) {
      tip.hidden = true;
      return;
    }
    const p = view.pool;
    const owners = p.ownerOf(b);
    let text = `block ${b}\nreference count ${p.ref[b]}\n`;
    if (p.lora[b]) text += `a page of LoRA adapter ${p.lora[b]}${p.slot[b] ? " (static slot)" : ""}\n`;
    else if (p.slot[b]) text += "an empty page of a static adapter slot\n";
    else text += p.ref[b] ? `${p.fill[b]}/${p.bs} tokens\n` : p.cached[b] ? "free, cached\n" : "free\n";
    if (p.cached[b] && p.ref[b]) text += "prefix-cached\n";
    if (owners.length) text += "requests: " + owners.map(short).join(", ") + "\n";
    if (p.text.has(b)) text += JSON.stringify(p.text.get(b));
    tip.textContent = text.trim();
    tip.style.left = ev.clientX + 14 + "px";
    tip.style.top = ev.clientY + 14 + "px";
    tip.hidden = false;
  });
  $("grid").addEventListener("mouseleave", () => {
    $("tip").hidden = true;
    view.hover = -1;
    view.dirty = true;
  });
  $("grid").addEventListener("click", (ev) => {
    const b = blockAt(ev);
    const owners = b >= 0 ? view.pool.ownerOf(b) : [];
    view.selected = owners.length ? owners[0] : null;
    view.userPicked = owners.length > 0;
    view.reqsDue = 0;
    view.dirty = true;
  });
  $("reqlist").addEventListener("click", (ev) => {
    const row = ev.target.closest("[data-req]");
    if (!row) return;
    view.selected = row.dataset.req;
    view.userPicked = true;
    view.reqsDue = 0;
    view.dirty = true;
  });
  $("noisy").addEventListener("change", () => { view.dirty = true; });
  window.addEventListener("resize", () => { view.dirty = true; });

  requestAnimationFrame(frame);
  if (CONFIG.mode === "replay") {
    startReplay(JSON.parse(document.getElementById("kv-trace").textContent));
  } else {
    $("subtitle").textContent = "live";
    connectLive();
  }
})();
