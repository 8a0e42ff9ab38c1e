// The report's interaction: the layer x head grid selects a head, whose attention on each stored
// text is drawn by CircuitsVis (AttentionPattern) with a token strip of our own (hover a token: the
// others are shaded by the attention it pays them); tables sort by a click on a header and filter
// by role. Everything it needs is in the page: the data lie in <script id="report-data">.
"use strict";
(() => {
  const data = JSON.parse(document.getElementById("report-data").textContent);
  const grid = document.getElementById("head-grid");

  // --- patterns: per view, the lower triangles of every head's (q, k) pattern, uint8 (x / 255), base64
  function decode(base64) {
    const raw = atob(base64);
    const bytes = new Uint8Array(raw.length);
    for (let i = 0; i < raw.length; i++) bytes[i] = raw.charCodeAt(i);
    return bytes;
  }
  const views = (data.views || []).map((view) => ({ ...view, bytes: decode(view.patterns) }));

  function pattern(view, layer, head) {  // -> rows[q][k] for k <= q, zero above the diagonal
    const n = view.tokens.length, triangle = (n * (n + 1)) / 2;
    const offset = (layer * data.n_heads + head) * triangle;
    const rows = [];
    for (let q = 0; q < n; q++) {
      const start = offset + (q * (q + 1)) / 2;
      const row = new Array(n).fill(0);
      for (let k = 0; k <= q; k++) row[k] = view.bytes[start + k] / 255;
      rows.push(row);
    }
    return rows;
  }

  // --- colours
  const VIRIDIS = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
  function viridis(t) {
    t = Math.min(1, Math.max(0, t)) * (VIRIDIS.length - 1);
    const i = Math.min(VIRIDIS.length - 2, Math.floor(t)), f = t - i;
    return VIRIDIS[i].map((c, j) => Math.round(c + f * (VIRIDIS[i + 1][j] - c)));
  }
  function diverging(t) {  // t in [-1, 1]: blue - white - red
    const a = Math.min(1, Math.abs(t));
    const end = t < 0 ? [33, 102, 172] : [178, 24, 43];
    return end.map((c) => Math.round(255 + a * (c - 255)));
  }
  function cellColour(measure, value, scale) {
    const rgb = data.bounded.includes(measure) ? viridis(value) : diverging(scale ? value / scale : 0);
    const light = 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2];
    return { background: `rgb(${rgb.join(",")})`, color: light > 140 ? "#111" : "#fff" };
  }

  // --- the layer x head grid
  const measureSelect = document.getElementById("grid-measure");
  function paintGrid() {
    const measure = measureSelect.value, values = data.grid[measure];
    const scale = Math.max(1e-9, ...values.filter((v) => v !== null).map(Math.abs));
    grid.querySelectorAll("button[data-layer]").forEach((button) => {
      const value = values[+button.dataset.layer * data.n_heads + +button.dataset.head];
      const missing = value === null;  // not measured (NaN in the table)
      Object.assign(button.style, missing ? { background: "#ddd", color: "#111" } : cellColour(measure, value, scale));
      button.textContent = data.n_heads <= 16 && !missing ? value.toFixed(2) : "";
      button.title = `L${button.dataset.layer}H${button.dataset.head}: ${measure} ${missing ? "n/a" : value.toFixed(3)}`;
    });
  }
  if (measureSelect) measureSelect.addEventListener("change", paintGrid);

  // --- the selected head's views
  function tokenStrip(host, tokens, rows) {
    const strip = document.createElement("div");
    strip.className = "token-strip";
    const spans = tokens.map((token, i) => {
      const span = document.createElement("span");
      span.textContent = token;
      span.dataset.index = i;
      strip.appendChild(span);
      return span;
    });
    function shade(q) {
      spans.forEach((span, k) => {
        const a = k <= q ? rows[q][k] : 0;
        span.style.background = `rgba(33, 102, 172, ${a.toFixed(3)})`;
        span.style.color = a > 0.55 ? "#fff" : "";
        span.classList.toggle("query", k === q);
        span.title = k <= q ? `attention from ${q} to ${k}: ${a.toFixed(3)}` : "";
      });
      strip.dataset.query = q;
    }
    spans.forEach((span, q) => span.addEventListener("mouseenter", () => shade(q)));
    shade(tokens.length - 1);
    host.appendChild(strip);
  }

  // a measure's 95% interval beside its value, where the page stores one (explorer_data's "intervals")
  function interval(measure, index) {
    const bounds = (data.intervals || {})[measure];
    if (!bounds || bounds[index][0] === null || bounds[index][1] === null) return "";
    return ` [${bounds[index][0].toFixed(2)}, ${bounds[index][1].toFixed(2)}]`;
  }

  let drawn = 0;
  function showHead(layer, head) {
    const name = `L${layer}H${head}`, index = layer * data.n_heads + head;
    const panel = document.getElementById("pattern-panel");
    panel.dataset.head = name;
    document.getElementById("pattern-title").textContent = `${name}${data.roles[index] ? " \u2014 " + data.roles[index] : ""}`;
    document.getElementById("pattern-scores").textContent = data.measures
      .map((m) => `${m.replace(/_/g, " ")} ${data.grid[m][index] === null ? "n/a" : data.grid[m][index].toFixed(2)}`
        + interval(m, index))
      .join(" \u00b7 ");
    grid.querySelectorAll("button.selected").forEach((b) => b.classList.remove("selected"));
    const button = grid.querySelector(`button[data-layer="${layer}"][data-head="${head}"]`);
    if (button) button.classList.add("selected");
    document.querySelectorAll("tr[data-head-name]").forEach((tr) => tr.classList.toggle("selected", tr.dataset.headName === name));
    views.forEach((view, v) => {
      const rows = pattern(view, layer, head);
      const host = document.getElementById(`view-${v}`);
      host.replaceChildren();
      host.dataset.head = name;
      const chart = document.createElement("div");
      chart.className = "cv-host";
      chart.id = `cv-${v}-${++drawn}`;  // a fresh React root per drawing
      host.appendChild(chart);
      if (window.CircuitsVis) {
        CircuitsVis.render(chart.id, CircuitsVis.AttentionPattern,
          { tokens: view.tokens, attention: rows, minValue: 0, maxValue: 1, showAxisLabels: true, maskUpperTri: true });
      }
      tokenStrip(host, view.tokens, rows);
    });
  }
  if (grid) {
    grid.addEventListener("click", (event) => {
      const button = event.target.closest("button[data-layer]");
      if (button) showHead(+button.dataset.layer, +button.dataset.head);
    });
    paintGrid();
    showHead(data.start[0], data.start[1]);
  }

  // --- tables: sort on a header click (numbers by value, text alphabetically), filter by role
  function cellKey(cell) {
    const raw = cell.dataset.sort !== undefined ? cell.dataset.sort : cell.textContent.trim();
    const number = parseFloat(raw);
    return Number.isNaN(number) || !/^[-+.\d]/.test(raw) ? raw.toLowerCase() : number;
  }
  function sortBy(table, column, header) {
    const body = table.tBodies[0];
    const descending = header.getAttribute("aria-sort") !== "descending";
    table.querySelectorAll("th").forEach((th) => th.removeAttribute("aria-sort"));
    header.setAttribute("aria-sort", descending ? "descending" : "ascending");
    const rows = [...body.rows].map((row, i) => ({ row, i, key: cellKey(row.cells[column]) }));
    rows.sort((a, b) => {
      if (a.key === b.key) return a.i - b.i;
      const bigger = typeof a.key === typeof b.key ? a.key > b.key : typeof a.key === "string";
      return (bigger ? 1 : -1) * (descending ? -1 : 1);
    });
    rows.forEach(({ row }) => body.appendChild(row));
  }
  document.querySelectorAll("table.sortable").forEach((table) => {
    table.querySelectorAll("thead th").forEach((th, column) => th.addEventListener("click", () => sortBy(table, column, th)));
    table.querySelectorAll("tr[data-head-name]").forEach((tr) =>
      tr.addEventListener("click", () => showHead(+tr.dataset.layer, +tr.dataset.head)));
  });
  document.querySelectorAll("select[data-filter-table]").forEach((select) => {
    const table = document.getElementById(select.dataset.filterTable);
    select.addEventListener("change", () => {
      [...table.tBodies[0].rows].forEach((row) => {
        const roles = (row.dataset.roles || "").split(";");
        row.hidden = select.value !== "" && !roles.includes(select.value);
      });
    });
  });
  document.body.dataset.ready = "true";  // the browser test reads this: the script ran to its end
})();
