// gptlab explorer: next-token candidates, surprisal colouring, attention heatmaps, the logit lens
// and activation patching, all from the server's /api endpoints. No dependencies; everything is
// served by the same process.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { history: [], current: -1, generation: 0, maxSurprisal: 12, typing: null };

// Make whitespace visible in token labels.
function show(text) {
  return text.replace(/ /g, "\u2423").replace(/\n/g, "\u21b5").replace(/\t/g, "\u21e5") || "\u2205";
}

async function api(path, body) {
  const init = body === undefined ? {} : {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
  };
  const response = await fetch(path, init);
  const data = await response.json();
  if (!response.ok) throw new Error(data.error ? data.error.message : response.statusText);
  return data;
}

function renderCandidates(candidates, list = $("candidates"), onChoose = choose) {
  list.replaceChildren();
  const top = candidates.length ? candidates[0].prob : 1;
  for (const c of candidates) {
    const item = document.createElement("li");
    const button = document.createElement("button");
    button.className = "candidate";
    button.type = "button";
    button.dataset.text = c.text;
    button.title = `token ${c.id}: p = ${c.prob.toFixed(4)}`;
    const tok = document.createElement("span");
    tok.className = "tok";
    tok.textContent = show(c.text);
    const bar = document.createElement("span");
    bar.className = "bar";
    const fill = document.createElement("span");
    fill.style.width = `${(100 * c.prob) / top}%`;
    bar.append(fill);
    const pct = document.createElement("span");
    pct.className = "pct";
    pct.textContent = `${(100 * c.prob).toFixed(1)}%`;
    button.append(tok, bar, pct);
    button.addEventListener("click", () => onChoose(c.text));
    item.append(button);
    list.append(item);
  }
}

function surprisalColour(bits) {
  if (bits === null) return "#eef1f7";
  const t = Math.min(1, bits / state.maxSurprisal);
  return `hsl(${50 - 50 * t}, ${90 - 5 * t}%, ${92 - 42 * t}%)`;
}

function renderTokens(tokens) {
  const box = $("tokens");
  box.replaceChildren();
  for (const t of tokens) {
    const span = document.createElement("span");
    span.textContent = show(t.text);
    span.style.background = surprisalColour(t.surprisal);
    if (t.surprisal !== null && t.surprisal / state.maxSurprisal > 0.6) span.style.color = "#fff";
    span.title = t.surprisal === null
      ? "first token: nothing to predict it from"
      : `p = ${t.prob.toFixed(4)}, surprisal = ${t.surprisal.toFixed(2)} bits`;
    box.append(span);
  }
}

const FONT = "12px ui-monospace, Menlo, Consolas, monospace";

// A heatmap: rows x columns of cells coloured by colour(i, j), row labels at the left and column
// labels rotated above, each margin as wide as its longest label (at most maxLabel; the left one
// at least minLeft). Returns the geometry, for cellAt.
function drawGrid(canvas, rowLabels, colLabels, colour, { minLeft = 0, maxLabel, minCell, maxCell }) {
  const ctx = canvas.getContext("2d");
  ctx.font = FONT;
  const side = (labels) => Math.min(maxLabel, 12 + Math.max(...labels.map((l) => ctx.measureText(l).width)));
  const left = Math.max(minLeft, side(rowLabels)), top = side(colLabels);
  const rows = rowLabels.length, cols = colLabels.length;
  const cell = Math.max(minCell, Math.min(maxCell, Math.floor((Math.min(1100, canvas.parentElement.clientWidth - 30) - left) / cols)));
  canvas.width = left + cols * cell + 4;
  canvas.height = top + rows * cell + 4;
  ctx.font = FONT;
  ctx.fillStyle = "#fff";
  ctx.fillRect(0, 0, canvas.width, canvas.height);
  for (let i = 0; i < rows; i++) {
    for (let j = 0; j < cols; j++) {
      ctx.fillStyle = colour(i, j);
      ctx.fillRect(left + j * cell, top + i * cell, cell - 1, cell - 1);
    }
  }
  ctx.fillStyle = "#1d2330";
  ctx.textBaseline = "middle";
  ctx.textAlign = "right";
  rowLabels.forEach((label, i) => ctx.fillText(label, left - 6, top + i * cell + cell / 2, left - 8));
  ctx.textAlign = "left";
  colLabels.forEach((label, j) => {
    ctx.save();
    ctx.translate(left + j * cell + cell / 2, top - 6);
    ctx.rotate(-Math.PI / 2);
    ctx.fillText(label, 0, 0, top - 8);
    ctx.restore();
  });
  return { left, top, cell, rows, cols };
}

// The [row, column] of a drawGrid cell under a mouse event, or null.
function cellAt(canvas, grid, e) {
  const r = canvas.getBoundingClientRect();
  const scale = canvas.width / r.width;
  const i = Math.floor(((e.clientY - r.top) * scale - grid.top) / grid.cell);
  const j = Math.floor(((e.clientX - r.left) * scale - grid.left) / grid.cell);
  return i >= 0 && j >= 0 && i < grid.rows && j < grid.cols ? [i, j] : null;
}

function renderAttention(data) {
  const canvas = $("heatmap");
  const labels = data.tokens.map(show);
  const colour = (i, j) => (j > i ? "#f7f7f9" : `rgba(59, 111, 216, ${Math.sqrt(data.weights[i][j])})`);
  const grid = drawGrid(canvas, labels, labels, colour, { maxLabel: 140, minCell: 8, maxCell: 28 });
  canvas.dataset.tokens = String(labels.length);
  canvas.onmousemove = (e) => {
    const hit = cellAt(canvas, grid, e);
    $("cell").textContent = hit ? `${labels[hit[0]]} \u2192 ${labels[hit[1]]}: ${data.weights[hit[0]][hit[1]].toFixed(3)}` : "";
  };
}

function renderLens(data) {
  const table = $("lens");
  table.replaceChildren();
  const head = document.createElement("tr");
  head.append(document.createElement("th"));
  for (const t of data.tokens) {
    const th = document.createElement("th");
    th.textContent = show(t);
    head.append(th);
  }
  table.append(head);
  data.layers.forEach((name, layer) => {
    const row = document.createElement("tr");
    const th = document.createElement("th");
    th.textContent = name;
    row.append(th);
    for (const cell of data.top[layer]) {
      const td = document.createElement("td");
      const best = cell[0];
      td.textContent = show(best.text);
      td.title = `p = ${best.prob.toFixed(4)}`;
      td.dataset.prob = String(best.prob);
      td.style.background = `rgba(59, 111, 216, ${0.1 + 0.8 * best.prob})`;
      if (best.prob > 0.55) td.style.color = "#fff";
      row.append(td);
    }
    table.append(row);
  });
}

// Activation patching: the grid as a heatmap (blue: restores the clean answer, red: the
// opposite); a click on a cell shows the corrupted prompt's next tokens with that cell patched.
function patchRequest() {
  return {
    clean: $("prompt").value, corrupt: $("corrupt").value, right: $("right").value, wrong: $("wrong").value,
    over: $("over").value,
  };
}

function renderPatch(data) {
  const canvas = $("patchmap");
  const layers = data.grid.map((_, layer) => String(layer));
  const colour = (layer, u) => {
    const v = Math.max(-1, Math.min(1, data.grid[layer][u]));
    return v >= 0 ? `rgba(40, 90, 200, ${v})` : `rgba(210, 50, 40, ${-v})`;
  };
  const grid = drawGrid(canvas, layers, data.columns.map(show), colour, { minLeft: 40, maxLabel: 120, minCell: 10, maxCell: 36 });
  Object.assign(canvas.dataset, {
    rows: String(grid.rows), cols: String(grid.cols), left: String(grid.left), top: String(grid.top), cell: String(grid.cell),
  });
  canvas.onclick = async (e) => {
    const hit = cellAt(canvas, grid, e);
    if (!hit) return;
    const [layer, unit] = hit;
    try {
      const out = await api("/api/patch/cell", { ...patchRequest(), layer, unit, top: 10 });
      $("patch-cell-title").textContent =
        `layer ${layer}, ${data.over === "layer-pos" ? "position" : "head"} ${unit} (${data.grid[layer][unit].toFixed(3)}): next tokens of the patched run`;
      canvas.dataset.selected = `${layer},${unit}`;
      renderCandidates(out.patched, $("patch-cell"), () => {});
    } catch (err) {
      $("patch-status").textContent = `error: ${err.message}`;
    }
  };
}

async function runPatch() {
  $("patch-status").textContent = "\u2026";
  try {
    const data = await api("/api/patch", patchRequest());
    renderPatch(data);
    $("patch-status").textContent =
      `logit difference: clean ${data.clean.toFixed(3)}, corrupted ${data.corrupt.toFixed(3)}`;
  } catch (err) {
    $("patch-status").textContent = `error: ${err.message}`;
  }
}

async function refresh() {
  clearTimeout(state.typing); // this refresh supersedes one still waiting for typing to pause
  const generation = ++state.generation;
  const prompt = $("prompt").value;
  $("status").textContent = "\u2026";
  try {
    const layer = Number($("layer").value || 0);
    const head = Number($("head").value || 0);
    const [next, tokens, attention, lens] = await Promise.all([
      api("/api/next", { prompt, top: 10 }),
      api("/api/tokens", { prompt }),
      api("/api/attention", { prompt, layer, head }),
      api("/api/lens", { prompt }),
    ]);
    if (generation !== state.generation) return; // a newer prompt is on its way
    renderCandidates(next.candidates);
    renderTokens(tokens.tokens);
    renderAttention(attention);
    renderLens(lens);
    $("status").textContent = `${tokens.tokens.length} tokens`;
  } catch (err) {
    if (generation === state.generation) $("status").textContent = `error: ${err.message}`;
  }
}

async function refreshAttention() {
  try {
    renderAttention(await api("/api/attention", {
      prompt: $("prompt").value, layer: Number($("layer").value), head: Number($("head").value),
    }));
  } catch (err) {
    $("status").textContent = `error: ${err.message}`;
  }
}

function renderHistory() {
  const list = $("history");
  list.replaceChildren();
  state.history.forEach((prompt, i) => {
    const item = document.createElement("li");
    const previous = i > 0 ? state.history[i - 1] : null;
    // A chosen token extends the previous prompt: show what it added; an edited prompt: its end.
    item.textContent = previous !== null && prompt.startsWith(previous) && prompt !== previous
      ? show(prompt.slice(previous.length))
      : `\u270e \u2026${show(prompt.slice(-16))}`;
    item.title = prompt;
    if (i === state.current) item.className = "current";
    item.addEventListener("click", () => goTo(i));
    list.append(item);
  });
}

function record(prompt) {
  state.history = state.history.slice(0, state.current + 1);
  state.history.push(prompt);
  state.current = state.history.length - 1;
  renderHistory();
}

function goTo(i) {
  state.current = i;
  $("prompt").value = state.history[i];
  renderHistory();
  refresh();
}

function choose(text) {
  const prompt = $("prompt").value + text;
  $("prompt").value = prompt;
  record(prompt);
  refresh();
}

function fillSelect(select, count) {
  select.replaceChildren();
  for (let i = 0; i < count; i++) {
    const option = document.createElement("option");
    option.value = String(i);
    option.textContent = String(i);
    select.append(option);
  }
}

async function main() {
  const info = await api("/api/info");
  $("model-name").textContent = `${info.model}: ${info.n_layer} layers, ${info.n_head} heads, context ${info.block_size}`;
  fillSelect($("layer"), info.n_layer);
  fillSelect($("head"), info.n_head);
  $("prompt").addEventListener("input", () => {
    clearTimeout(state.typing);
    state.typing = setTimeout(refresh, 300);
  });
  $("go").addEventListener("click", () => {
    record($("prompt").value);
    refresh();
  });
  $("back").addEventListener("click", () => {
    if (state.current > 0) goTo(state.current - 1);
  });
  $("patch-go").addEventListener("click", runPatch);
  $("layer").addEventListener("change", refreshAttention);
  $("head").addEventListener("change", refreshAttention);
  record($("prompt").value);
  await refresh();
}

main();
