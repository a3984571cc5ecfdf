// pagedllm dashboard: draws /dashboard/state snapshots received over /dashboard/events (SSE).
// Plain canvas drawing, no library: the block map writes pixels straight into an ImageData,
// so a pool of 100,000 blocks costs about as much as one of 1,000.
(() => {
  'use strict';

  const config = JSON.parse(document.getElementById('dashboard-config').textContent);
  const FREE = 0, CACHED = 1, OWNED = 2, SHARED = 3, SWAPPED = 4;
  const STATE_NAMES = ['free', 'cached prefix (evictable)', 'used', 'shared', 'swapped out'];
  const MAP_MAX_HEIGHT = 360; // CSS px; more blocks make smaller cells, never a taller map
  const HISTORY_MAX = 2400;

  // State the browser test reads (window.dashboard): counts drawn, updates, render times.
  const dash = window.dashboard = {
    updates: 0, renders: 0, counts: null, chartPoints: 0, chartsDrawn: 0, lastDrawMs: 0, avgDrawMs: 0,
    maxDrawMs: 0, connected: false, snapshot: null, error: null, kvInfo: null, view: null, down: null,
  };
  const drawTimes = [];
  const history = [];

  // ------------------------------------------------------------------ connection and the key

  const params = new URLSearchParams(location.search);
  let apiKey = params.get('key') || sessionStorage.getItem('pagedllm-dashboard-key') || '';
  const base = location.pathname.replace(/\/+$/, '');
  // With data-parallel replicas: which view the page shows ('all', or a replica's number).
  let view = config.replicas ? (params.get('replica') || config.default_view).trim().toLowerCase() : null;
  dash.view = view;
  const url = (path) => {
    const query = new URLSearchParams();
    if (apiKey) query.set('key', apiKey);
    if (view !== null) query.set('replica', view);
    const text = query.toString();
    return base + path + (text ? '?' + text : '');
  };
  const statusEl = document.getElementById('status');
  const keyForm = document.getElementById('key-form');
  let source = null;
  let retryTimer = null;

  function setStatus(text, kind) {
    statusEl.textContent = text;
    statusEl.className = 'status ' + (kind || '');
  }

  async function connect() {
    clearTimeout(retryTimer);
    if (source) { source.close(); source = null; }
    let response;
    try {
      response = await fetch(url('/state'), { cache: 'no-store' });
    } catch (err) {
      setStatus('server unreachable, retrying…', 'error');
      retryTimer = setTimeout(connect, 3000);
      return;
    }
    if (response.status === 401) {
      // EventSource cannot send headers: the key travels as ?key=, asked for here if missing.
      setStatus(apiKey ? 'wrong API key' : 'API key required', 'error');
      keyForm.hidden = false;
      return;
    }
    if (response.status === 400 && view !== null && view !== config.default_view) {
      view = config.default_view; // ?replica= named no view (say, a replica count that changed)
      dash.view = view;
      connect();
      return;
    }
    if (!response.ok) {
      setStatus('error ' + response.status + ', retrying…', 'error');
      retryTimer = setTimeout(connect, 3000);
      return;
    }
    keyForm.hidden = true;
    const first = await response.json();
    if (first.view !== undefined && first.view !== view) return; // switched meanwhile: that connect() wins
    receive(first, false);
    source = new EventSource(url('/events'));
    source.addEventListener('open', () => { dash.connected = true; setStatus('live', 'live'); });
    source.addEventListener('history', (event) => {
      history.length = 0;
      for (const point of JSON.parse(event.data)) history.push(point);
    });
    source.addEventListener('state', (event) => receive(JSON.parse(event.data), true));
    source.addEventListener('end', () => {
      dash.connected = false;
      setStatus('server stopped; reconnecting…', 'error');
      source.close();
      retryTimer = setTimeout(connect, 3000);
    });
    source.addEventListener('error', () => {
      dash.connected = false;
      setStatus('reconnecting…', 'error'); // EventSource retries by itself
    });
  }

  keyForm.addEventListener('submit', (event) => {
    event.preventDefault();
    apiKey = document.getElementById('key-input').value;
    sessionStorage.setItem('pagedllm-dashboard-key', apiKey);
    connect();
  });

  // ------------------------------------------------------------------ the replica selector

  const picker = document.getElementById('replica-picker');
  const select = document.getElementById('replica-select');

  // Options: every replica together, then each replica with its live state (from each update).
  function updatePicker(s) {
    if (!s.replicas) return;
    picker.hidden = false;
    const live = s.replicas.filter((r) => r.live).length;
    const options = [['all', `all (${live} of ${s.replicas.length} live)`]].concat(
      s.replicas.map((r) => [String(r.replica), `replica ${r.replica} (${r.live ? 'live' : 'dead'})`]));
    const current = [...select.options].map((o) => o.value + '\u0000' + o.textContent).join('\n');
    if (current !== options.map(([v, t]) => v + '\u0000' + t).join('\n')) {
      select.innerHTML = options.map(([v, t]) =>
        `<option value="${escapeHtml(v)}" data-live="${t.includes('(dead)') ? 'false' : 'true'}">${escapeHtml(t)}</option>`).join('');
    }
    select.value = view;
  }

  select.addEventListener('change', () => {
    view = select.value;
    dash.view = view;
    const query = new URLSearchParams(location.search);
    query.set('replica', view);
    history.length = 0; // the new view's own series arrive with its stream
    dash.updates = 0;
    pending = null;
    window.history.replaceState(null, '', location.pathname + '?' + query.toString());
    connect();
  });

  // ------------------------------------------------------------------ updates, one render per frame

  let pending = null;
  function receive(snapshot, streamed) {
    if (snapshot.view !== undefined && snapshot.view !== view) return; // from the view just left
    if (streamed && snapshot.point) {
      dash.updates += 1;
      history.push(snapshot.point);
      if (history.length > HISTORY_MAX) history.splice(0, history.length - HISTORY_MAX);
    }
    const first = pending === null;
    pending = snapshot;
    if (first) requestAnimationFrame(renderPending);
  }

  function renderPending() {
    const snapshot = pending;
    pending = null;
    if (!snapshot) return;
    const start = performance.now();
    render(snapshot);
    const ms = performance.now() - start;
    drawTimes.push(ms);
    if (drawTimes.length > 50) drawTimes.shift();
    dash.lastDrawMs = ms;
    dash.maxDrawMs = Math.max(dash.maxDrawMs, ms);
    dash.avgDrawMs = drawTimes.reduce((a, b) => a + b, 0) / drawTimes.length;
    dash.renders += 1;
  }

  function render(s) {
    dash.snapshot = s;
    updatePicker(s);
    const down = document.getElementById('replica-down');
    dash.down = s.down || null;
    down.hidden = !s.down;
    document.getElementById('pools').hidden = !!s.down;
    document.getElementById('map-legend').hidden = !!s.down;
    document.getElementById('kv-info').hidden = !!s.down;
    if (s.down) { // a replica down: say so where its pool was; its charts keep their history
      down.textContent = s.down;
      document.getElementById('pool-info').textContent = '';
      document.querySelector('#requests tbody').innerHTML = '';
      document.getElementById('requests-note').textContent = 'none: down';
      drawCharts();
      return;
    }
    document.getElementById('title').textContent = config.title + (s.simulated ? ' (SIMULATED)' : '');
    const b = s.blocks;
    const kv = s.kv_cache;
    document.getElementById('pool-info').textContent =
      `${b.total.toLocaleString()} blocks × ${s.block_size} tokens` + (kv ? ` · ${kvDtypeLabel(kv)} KV` : '') +
      ` · ${s.kv_allocation} · KV usage ${(100 * b.used / Math.max(1, b.total)).toFixed(1)}%` +
      (s.segments ? ` · ${s.segments.length} replica pools side by side` : '');
    renderKvInfo(s);
    const counts = drawMaps(s);
    dash.counts = counts;
    for (const [name, value] of Object.entries(counts)) {
      const el = document.getElementById('count-' + name);
      if (el) { el.textContent = value.toLocaleString(); el.dataset.count = String(value); }
    }
    drawCharts();
    renderRequests(s);
  }

  // ------------------------------------------------------------------ the pool's format and size

  // "int8", or "auto (bfloat16)": the setting, with the dtype "auto" stores.
  function kvDtypeLabel(kv) {
    return kv.dtype === 'auto' && kv.storage ? `auto (${kv.storage})` : String(kv.dtype);
  }

  function formatBytes(bytes) {
    const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
    let i = 0;
    while (bytes >= 1024 && i < units.length - 1) { bytes /= 1024; i += 1; }
    return i === 0 ? `${bytes} B` : `${bytes.toFixed(1)} ${units[i]}`;
  }

  function setValue(id, text, value) {
    const el = document.getElementById(id);
    el.textContent = text;
    el.dataset.value = String(value);
  }

  function renderKvInfo(s) {
    const kv = s.kv_cache || null;
    const b = s.blocks;
    document.getElementById('kv-dtype-item').hidden = !kv;
    document.getElementById('kv-bytes-item').hidden = !(kv && kv.bytes_per_token);
    if (kv) {
      setValue('kv-dtype', kvDtypeLabel(kv), kv.dtype);
      if (kv.bytes_per_token) {
        setValue('kv-bytes-per-token', kv.bytes_per_token.toLocaleString(), kv.bytes_per_token);
        const perRank = kv.tensor_parallel_size > 1 ? ', per rank' : '';
        document.getElementById('kv-bytes-note').textContent = `(K and V, all layers, scales included${perRank})`;
      }
    }
    setValue('kv-gpu-blocks', b.total.toLocaleString(), b.total);
    const cpuBlocks = b.cpu_total || 0;
    setValue('kv-cpu-blocks', cpuBlocks.toLocaleString(), cpuBlocks);
    document.getElementById('kv-pool-bytes').textContent =
      kv && kv.pool_bytes != null ? ` (${formatBytes(kv.pool_bytes)})` : '';
    document.getElementById('kv-cpu-pool-bytes').textContent =
      kv && kv.cpu_pool_bytes ? ` (${formatBytes(kv.cpu_pool_bytes)})` : '';
    dash.kvInfo = kv ? { ...kv, gpu_blocks: b.total, cpu_blocks: cpuBlocks } : null;
  }

  // ------------------------------------------------------------------ colours

  function hashHue(text) {
    let h = 2166136261;
    for (let i = 0; i < text.length; i++) { h ^= text.charCodeAt(i); h = Math.imul(h, 16777619); }
    // Hues 50..300 only: the reds and oranges belong to shared blocks.
    return 50 + ((h >>> 0) % 250);
  }
  function hslToRgb(h, s, l) {
    const k = (n) => (n + h / 30) % 12, a = s * Math.min(l, 1 - l);
    const f = (n) => l - a * Math.max(-1, Math.min(k(n) - 3, Math.min(9 - k(n), 1)));
    return [Math.round(255 * f(0)), Math.round(255 * f(8)), Math.round(255 * f(4))];
  }
  const requestColours = new Map();
  function requestColour(id) {
    let rgb = requestColours.get(id);
    if (!rgb) {
      rgb = hslToRgb(hashHue(id), 0.62, 0.5);
      if (requestColours.size > 5000) requestColours.clear();
      requestColours.set(id, rgb);
    }
    return rgb;
  }
  function sharedColour(ref) {
    const t = Math.min(1, (ref - 2) / 6); // ref 2 light orange ... ref 8+ dark red
    return [Math.round(247 + (120 - 247) * t), Math.round(178 + (20 - 178) * t), Math.round(103 + (30 - 103) * t)];
  }
  const C_FREE = [230, 233, 238], C_CACHED = [143, 188, 187], C_SWAPPED = [126, 87, 194], C_CPU_FREE = [237, 231, 246];
  const pack = (rgb) => (255 << 24) | (rgb[2] << 16) | (rgb[1] << 8) | rgb[0]; // ImageData is RGBA little-endian
  const tint = (rgb, amount) => rgb.map((v) => Math.round(v + (255 - v) * amount));

  // ------------------------------------------------------------------ block map

  const layouts = new Map();

  function layoutFor(canvas, numBlocks, maxHeight) {
    const width = Math.max(60, canvas.clientWidth || canvas.parentElement.clientWidth);
    let cell = Math.floor(Math.sqrt((width * maxHeight) / Math.max(1, numBlocks)));
    cell = Math.max(1, Math.min(22, cell));
    const cols = Math.max(1, Math.floor(width / cell));
    const rows = Math.max(1, Math.ceil(numBlocks / cols));
    return { cell, cols, rows, gap: cell >= 5 ? 1 : 0, numBlocks };
  }

  function drawPool(canvas, map, requests, blockSize, isCpu, maxHeight) {
    const n = map.state.length;
    const layout = layoutFor(canvas, n, maxHeight);
    layouts.set(canvas, { layout, map, requests, blockSize, isCpu });
    if (!isCpu) dash.layout = layout;
    const { cell, cols, rows, gap } = layout;
    const width = cols * cell, height = rows * cell;
    if (canvas.width !== width || canvas.height !== height) {
      canvas.width = width; canvas.height = height;
      canvas.style.height = height + 'px';
    }
    if (n === 0) return;
    const ctx = canvas.getContext('2d');
    const image = ctx.createImageData(width, height);
    const pixels = new Uint32Array(image.data.buffer);
    const background = pack([250, 251, 252]);
    pixels.fill(background);
    const ownerColour = requests.map((r) => requestColour(r.id));
    const inner = cell - gap;
    const partial = inner >= 6; // big cells show their fill as a lighter unwritten part
    for (let i = 0; i < n; i++) {
      const state = map.state[i];
      let full, empty;
      if (state === FREE) {
        full = empty = pack(isCpu ? C_CPU_FREE : C_FREE);
      } else if (state === CACHED) {
        full = empty = pack(C_CACHED);
      } else if (state === SWAPPED && map.ref[i] <= 1) {
        full = empty = pack(C_SWAPPED);
      } else {
        const rgb = (state === SHARED || map.ref[i] > 1) ? sharedColour(map.ref[i])
          : (map.owner[i] >= 0 ? ownerColour[map.owner[i]] : [79, 143, 216]);
        const fill = Math.min(1, map.fill[i] / blockSize);
        if (partial) { full = pack(rgb); empty = pack(tint(rgb, 0.72)); }
        else { full = empty = pack(tint(rgb, 0.55 * (1 - fill))); }
        if (partial) {
          const x0 = (i % cols) * cell, y0 = Math.floor(i / cols) * cell;
          const filledRows = Math.round(inner * fill);
          for (let y = 0; y < inner; y++) {
            const colour = (inner - y) <= filledRows ? full : empty;
            const row = (y0 + y) * width + x0;
            for (let x = 0; x < inner; x++) pixels[row + x] = colour;
          }
          continue;
        }
      }
      const x0 = (i % cols) * cell, y0 = Math.floor(i / cols) * cell;
      for (let y = 0; y < inner; y++) {
        const row = (y0 + y) * width + x0;
        for (let x = 0; x < inner; x++) pixels[row + x] = full;
      }
    }
    // All replicas' pools in one map: a dark bar on the left of each replica's first block but the first.
    const segments = dash.snapshot && dash.snapshot.segments;
    if (segments) {
      const edge = pack([29, 35, 48]), startKey = isCpu ? 'cpu_start' : 'start';
      const barWidth = Math.max(1, Math.floor(inner / 4));
      for (const seg of segments) {
        const start = seg[startKey];
        if (start <= 0 || start >= n) continue;
        const x0 = (start % cols) * cell, y0 = Math.floor(start / cols) * cell;
        for (let y = 0; y < cell; y++) for (let x = 0; x < barWidth; x++) pixels[(y0 + y) * width + x0 + x] = edge;
      }
    }
    ctx.putImageData(image, 0, 0);
  }

  function drawMaps(s) {
    const gpuCanvas = document.getElementById('gpu-map');
    const cpuCanvas = document.getElementById('cpu-map');
    drawPool(gpuCanvas, s.map, s.requests, s.block_size, false, MAP_MAX_HEIGHT);
    const hasCpu = s.cpu_map.state.length > 0;
    cpuCanvas.hidden = !hasCpu;
    document.getElementById('cpu-empty').hidden = hasCpu;
    // The swap pool beside the device pool, never taller than it.
    if (hasCpu) drawPool(cpuCanvas, s.cpu_map, s.requests, s.block_size, true, Math.max(40, gpuCanvas.height));
    // Counted from the drawn cells themselves, not copied from the summary.
    const counts = { free: 0, cached: 0, owned: 0, shared: 0, swapped: 0 };
    for (const state of s.map.state) {
      if (state === FREE) counts.free++; else if (state === CACHED) counts.cached++;
      else if (state === OWNED) counts.owned++; else if (state === SHARED) counts.shared++;
    }
    for (const state of s.cpu_map.state) if (state === SWAPPED) counts.swapped++;
    counts.used = counts.owned + counts.shared;
    counts.total = s.map.state.length;
    return counts;
  }

  // In the all-replicas view the pools sit side by side: a cell's replica and its block id there.
  function whereIs(id, isCpu) {
    const segments = dash.snapshot && dash.snapshot.segments;
    if (!segments) return { prefix: '', id };
    const startKey = isCpu ? 'cpu_start' : 'start', sizeKey = isCpu ? 'cpu_blocks' : 'blocks';
    for (const seg of segments) {
      if (id >= seg[startKey] && id < seg[startKey] + seg[sizeKey]) {
        return { prefix: `replica ${seg.replica}: `, id: id - seg[startKey] };
      }
    }
    return { prefix: '', id };
  }

  const tooltip = document.getElementById('tooltip');
  function onHover(event) {
    const entry = layouts.get(event.target);
    if (!entry) return;
    const { layout, map, requests, blockSize, isCpu } = entry;
    const rect = event.target.getBoundingClientRect();
    const x = (event.clientX - rect.left) * (event.target.width / rect.width);
    const y = (event.clientY - rect.top) * (event.target.height / rect.height);
    const col = Math.floor(x / layout.cell), row = Math.floor(y / layout.cell);
    const id = row * layout.cols + col;
    if (col >= layout.cols || id < 0 || id >= map.state.length) { tooltip.hidden = true; return; }
    const ownerIndices = map.owners[String(id)] || (map.owner[id] >= 0 ? [map.owner[id]] : []);
    const owners = ownerIndices.map((k) => (requests[k] ? requests[k].id : '?'));
    const where = whereIs(id, isCpu);
    const lines = [
      `${where.prefix}${isCpu ? 'CPU' : 'device'} block #${where.id}: ${STATE_NAMES[map.state[id]]}`,
      `ref count ${map.ref[id]} · fill ${map.fill[id]}/${blockSize} slots`,
    ];
    if (owners.length) lines.push('owners: ' + owners.slice(0, 6).join(', ') + (owners.length > 6 ? ` (+${owners.length - 6})` : ''));
    tooltip.textContent = lines.join('\n');
    tooltip.hidden = false;
    tooltip.style.left = Math.min(window.innerWidth - 370, event.clientX + 14) + 'px';
    tooltip.style.top = (event.clientY + 14) + 'px';
  }
  for (const id of ['gpu-map', 'cpu-map']) {
    const canvas = document.getElementById(id);
    canvas.addEventListener('mousemove', onHover);
    canvas.addEventListener('mouseleave', () => { tooltip.hidden = true; });
  }

  // ------------------------------------------------------------------ charts

  function fmt(value) {
    if (value === null || value === undefined || Number.isNaN(value)) return '–';
    const abs = Math.abs(value);
    if (abs >= 1e6) return (value / 1e6).toFixed(1) + 'M';
    if (abs >= 1e4) return (value / 1e3).toFixed(1) + 'k';
    if (abs >= 100) return value.toFixed(0);
    if (abs >= 10) return value.toFixed(1);
    return value.toFixed(2).replace(/\.?0+$/, '') || '0';
  }

  // series: [{name, colour, get(point) -> number|null}]; options: {stacked, percent}
  function drawChart(id, series, options) {
    const canvas = document.getElementById('chart-' + id);
    const ratio = window.devicePixelRatio || 1;
    const cssWidth = canvas.clientWidth || 380, cssHeight = canvas.clientHeight || 170;
    if (canvas.width !== Math.round(cssWidth * ratio) || canvas.height !== Math.round(cssHeight * ratio)) {
      canvas.width = Math.round(cssWidth * ratio); canvas.height = Math.round(cssHeight * ratio);
    }
    const ctx = canvas.getContext('2d');
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, cssWidth, cssHeight);
    const left = 44, right = 8, top = 6, bottom = 18;
    const plotW = cssWidth - left - right, plotH = cssHeight - top - bottom;
    const points = history;
    const n = points.length;
    const tEnd = n ? points[n - 1].t : 0;
    const span = n > 1 ? Math.max(30, tEnd - points[0].t) : 30;
    const xOf = (t) => left + plotW * (1 - (tEnd - t) / span);
    // Values (stacked sums when stacked).
    const values = series.map(() => new Array(n));
    for (let i = 0; i < n; i++) {
      let acc = 0;
      for (let k = 0; k < series.length; k++) {
        let v = series[k].get(points[i]);
        if (options.stacked) { acc += v || 0; v = acc; }
        values[k][i] = v;
      }
    }
    let yMax = options.percent ? 100 : 0;
    if (!options.percent) {
      for (const vs of values) for (const v of vs) if (v !== null && v !== undefined && v > yMax) yMax = v;
      yMax = yMax > 0 ? niceCeil(yMax * 1.08) : 1;
    }
    const yOf = (v) => top + plotH * (1 - v / yMax);
    // Grid and axis labels.
    ctx.strokeStyle = '#e3e6eb'; ctx.fillStyle = '#6b7280'; ctx.lineWidth = 1;
    ctx.font = '10px system-ui, sans-serif'; ctx.textAlign = 'right'; ctx.textBaseline = 'middle';
    for (let g = 0; g <= 4; g++) {
      const v = (yMax * g) / 4, y = Math.round(yOf(v)) + 0.5;
      ctx.beginPath(); ctx.moveTo(left, y); ctx.lineTo(left + plotW, y); ctx.stroke();
      ctx.fillText(fmt(v) + (options.percent ? '%' : ''), left - 4, y);
    }
    ctx.textAlign = 'center'; ctx.textBaseline = 'top';
    for (let g = 0; g <= 3; g++) {
      const ago = (span * (3 - g)) / 3;
      ctx.fillText(ago === 0 ? 'now' : `-${fmt(ago)}s`, left + (plotW * g) / 3, top + plotH + 4);
    }
    // Series: areas from the previous stack level when stacked, lines otherwise.
    for (let k = series.length - 1; k >= 0; k--) {
      const s = series[k], vs = values[k];
      ctx.beginPath();
      let started = false;
      for (let i = 0; i < n; i++) {
        const v = vs[i];
        if (v === null || v === undefined) { started = false; continue; }
        const x = xOf(points[i].t), y = yOf(v);
        if (!started) { ctx.moveTo(x, y); started = true; } else ctx.lineTo(x, y);
      }
      if (options.stacked && n > 0) {
        for (let i = n - 1; i >= 0; i--) ctx.lineTo(xOf(points[i].t), yOf(k > 0 ? values[k - 1][i] || 0 : 0));
        ctx.closePath();
        ctx.fillStyle = s.colour; ctx.fill();
      } else {
        ctx.strokeStyle = s.colour; ctx.lineWidth = 1.6; ctx.stroke();
      }
    }
    // Legend with the latest values.
    const legend = document.getElementById('legend-' + id);
    const last = n ? points[n - 1] : null;
    legend.innerHTML = series.map((s) => {
      const v = last ? s.get(last) : null;
      const shown = options.percent ? (v === null ? '–' : v.toFixed(1) + '%') : fmt(v);
      return `<span><i class="sw" style="background:${s.colour}"></i>${s.name} <b>${shown}</b></span>`;
    }).join('') + (options.extra ? options.extra(last) : '');
  }

  function niceCeil(v) {
    const exp = Math.pow(10, Math.floor(Math.log10(v)));
    for (const m of [1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10]) if (m * exp >= v) return m * exp;
    return 10 * exp;
  }

  const pct = (name) => (p) => 100 * p.waste[name] / Math.max(1, totalSlots(p));
  const totalSlots = (p) => p.waste.token + p.waste.reserved + p.waste.internal + p.waste.external + p.waste.free;
  const ms = (group, q) => (p) => (p[group][q] === null || p[group][q] === undefined ? null : 1000 * p[group][q]);

  function drawCharts() {
    drawChart('memory', [
      { name: 'token states', colour: '#3b7dd8', get: pct('token') },
      { name: 'reserved', colour: '#7fb3ea', get: pct('reserved') },
      { name: 'internal frag.', colour: '#f0a04b', get: pct('internal') },
      { name: 'external frag.', colour: '#d64545', get: pct('external') },
      { name: 'free', colour: '#e6e9ee', get: pct('free') },
    ], { stacked: true, percent: true });
    drawChart('sharing', [
      { name: 'by forks (samples, beams)', colour: '#e76f51', get: (p) => p.saved.forks },
      { name: 'by prefix-cache hits', colour: '#2a9d8f', get: (p) => p.saved.prefix },
    ], { stacked: true, extra: () => {
      const sh = dash.snapshot ? dash.snapshot.sharing : null;
      return sh ? `<span>CoW copies <b>${fmt(sh.cow_copies)}</b></span><span>prefix hit tokens <b>${fmt(sh.prefix_hit_tokens)}</b></span>` : '';
    } });
    drawChart('queues', [
      { name: 'running', colour: '#2f855a', get: (p) => p.queues.running },
      { name: 'waiting', colour: '#d69e2e', get: (p) => p.queues.waiting },
      { name: 'swapped', colour: '#7e57c2', get: (p) => p.queues.swapped },
    ], { extra: (last) => `<span>preemptions <b>${last ? fmt(last.preemptions) : '–'}</b></span>` });
    drawChart('throughput', [
      { name: 'prompt', colour: '#805ad5', get: (p) => p.tps.prompt },
      { name: 'generation', colour: '#3182ce', get: (p) => p.tps.generation },
    ], {});
    drawChart('ttft', [
      { name: 'p50', colour: '#38a169', get: ms('ttft', 'p50') },
      { name: 'p90', colour: '#d69e2e', get: ms('ttft', 'p90') },
      { name: 'p99', colour: '#e53e3e', get: ms('ttft', 'p99') },
    ], {});
    drawChart('itl', [
      { name: 'p50', colour: '#38a169', get: ms('itl', 'p50') },
      { name: 'p90', colour: '#d69e2e', get: ms('itl', 'p90') },
      { name: 'p99', colour: '#e53e3e', get: ms('itl', 'p99') },
    ], {});
    dash.chartPoints = history.length;
    dash.chartsDrawn += 1;
  }

  // ------------------------------------------------------------------ requests table

  const escapeHtml = (text) => String(text).replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);
  const MAX_ROWS = 200;

  function renderRequests(s) {
    const rows = s.requests.slice(0, MAX_ROWS).map((r) => {
      const rgb = requestColour(r.id);
      return `<tr><td><i class="sw" style="background:rgb(${rgb.join(',')})"></i></td>` +
        `<td class="id" title="${escapeHtml(r.id)}">` +
        (r.replica !== undefined ? `<span class="replica-tag">r${r.replica}</span>` : '') + `${escapeHtml(r.id)}</td>` +
        `<td class="state-${r.state}">${r.state}</td><td>${r.num_seqs}</td><td>${r.prompt_tokens}</td>` +
        `<td>${r.output_tokens}</td><td>${r.blocks}</td><td>${r.shared_blocks}</td><td>${r.preemptions}</td></tr>`;
    });
    document.querySelector('#requests tbody').innerHTML = rows.join('');
    const hidden = Math.max(0, s.requests.length - MAX_ROWS) + (s.requests_omitted || 0);
    document.getElementById('requests-note').textContent =
      `${s.queues.running} running · ${s.queues.waiting} waiting · ${s.queues.swapped} swapped` +
      (hidden ? ` · ${hidden} more not listed` : '');
  }

  window.addEventListener('resize', () => { if (dash.snapshot) receive(dash.snapshot, false); });
  connect();
})();
