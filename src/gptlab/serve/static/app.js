// gptlab explorer: next-token candidates, surprisal colouring, attention heatmaps, the logit lens
// and activation patching, all from the server's /api endpoints. No dependencies; everything is
// served by the same process.
"use strict";

const $ = (id) => document.getElementById(id);
// The prompt is the textarea's text until a token is picked; from then on it is the token ids
// (state.ids), so the model continues from the token chosen (a piece of a character, or a token
// the text would re-encode merged with the one before), until the text is edited.
const state = {
  history: [], current: -1, generation: 0, attention: 0, patch: 0, patchCell: 0, maxSurprisal: 12, typing: null, ids: null, shownIds: null,
  info: null, // /api/info's answer, once it came
};

// Make spaces visible in token labels (the server's labels escape other control characters).
function show(label) {
  return label.replace(/ /g, "\u2423") || "\u2205";
}

function prompt() {
  return state.ids ?? $("prompt").value;
}

// The panels that show the prompt's analysis; each render takes its own panel's stale mark off.
const PANELS = ["candidates", "tokens", "heatmap", "lens"];

// The prompt changed: every panel shows the old one until the refresh (dimmed; a click on a
// candidate does nothing meanwhile), and still does if the refresh fails.
function stale() {
  state.shownIds = null;
  state.attention++; // a heatmap still loading (a layer picked) is of the old prompt: not drawn
  for (const id of PANELS) $(id).classList.add("stale");
}

async function api(path, body) {
  const init = body === undefined ? {} : {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
  };
  const response = await fetch(path, init);
  // a proxy's or a dying server's page is no JSON: its status is the message
  const data = await response.json().catch(() => ({}));
  if (!response.ok) throw new Error(data.error ? data.error.message : `${response.status} ${response.statusText}`);
  return data;
}

function renderCandidates(candidates, list = $("candidates"), onChoose = choose) {
  list.replaceChildren();
  list.classList.remove("stale");
  const top = candidates.length ? candidates[0].prob : 1;
  for (const c of candidates) {
    const item = document.createElement("li");
    // a list that does nothing on a click shows plain rows, not buttons
    const button = document.createElement(onChoose ? "button" : "div");
    button.className = "candidate";
    if (onChoose) button.type = "button";
    button.dataset.text = c.text;
    button.dataset.id = String(c.id);
    button.title = `token ${c.id}: p = ${c.prob.toFixed(4)}`;
    const tok = document.createElement("span");
    tok.className = "tok";
    tok.textContent = show(c.label);
    const bar = document.createElement("span");
    bar.className = "bar";
    const fill = document.createElement("span");
    fill.style.width = `${(100 * c.prob) / top}%`;
    bar.append(fill);
    const pct = document.createElement("span");
    pct.className = "pct";
    pct.textContent = `${(100 * c.prob).toFixed(1)}%`;
    button.append(tok, bar, pct);
    if (onChoose) button.addEventListener("click", () => onChoose(c));
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
  box.classList.remove("stale");
  for (const t of tokens) {
    const span = document.createElement("span");
    span.textContent = show(t.label);
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

// A grid reachable from the keyboard: Tab to the canvas, the arrow keys move a cursor from cell
// to cell (starting at the top left) and call onCell(i, j), as the mouse does.
function gridKeys(canvas, grid, onCell) {
  canvas.tabIndex = 0;
  let cursor = null;
  canvas.onkeydown = (e) => {
    const step = { ArrowUp: [-1, 0], ArrowDown: [1, 0], ArrowLeft: [0, -1], ArrowRight: [0, 1] }[e.key];
    if (!step && e.key !== "Enter") return;
    e.preventDefault();
    const [i, j] = cursor ?? [0, 0];
    cursor = cursor && step
      ? [Math.max(0, Math.min(grid.rows - 1, i + step[0])), Math.max(0, Math.min(grid.cols - 1, j + step[1]))]
      : [i, j];
    onCell(...cursor);
  };
}

function renderAttention(data) {
  const canvas = $("heatmap");
  const labels = data.tokens.map(show);
  const colour = (i, j) => (j > i ? "#f7f7f9" : `rgba(59, 111, 216, ${Math.sqrt(data.weights[i][j])})`);
  const grid = drawGrid(canvas, labels, labels, colour, { maxLabel: 140, minCell: 8, maxCell: 28 });
  canvas.classList.remove("stale");
  Object.assign(canvas.dataset, { tokens: String(labels.length), layer: String(data.layer), head: String(data.head) });
  const describe = (i, j) => {
    $("cell").textContent = `${labels[i]} \u2192 ${labels[j]}: ${data.weights[i][j].toFixed(3)}`;
  };
  canvas.onmousemove = (e) => {
    const hit = cellAt(canvas, grid, e);
    if (hit) describe(...hit);
    else $("cell").textContent = "";
  };
  gridKeys(canvas, grid, describe);
}

function renderLens(data) {
  const table = $("lens");
  table.replaceChildren();
  table.classList.remove("stale");
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
      td.textContent = show(best.label);
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
    clean: prompt(), corrupt: $("corrupt").value, right: $("right").value, wrong: $("wrong").value,
    over: $("over").value,
  };
}

// The grid of `data`, drawn for `request`: a cell opens with that request, whatever the form
// holds now (the grid would otherwise be read with other prompts, answers or axes).
function renderPatch(data, request) {
  const canvas = $("patchmap");
  const layers = data.grid.map((_, layer) => String(layer));
  const colour = (layer, u) => {
    const v = Math.max(-1, Math.min(1, data.grid[layer][u]));
    return v >= 0 ? `rgba(40, 90, 200, ${v})` : `rgba(210, 50, 40, ${-v})`;
  };
  const columns = data.over === "layer-pos" ? data.columns.map(show) : data.columns; // tokens, or "head 0" (its space no token's)
  const grid = drawGrid(canvas, layers, columns, colour, { minLeft: 40, maxLabel: 120, minCell: 10, maxCell: 36 });
  Object.assign(canvas.dataset, {
    rows: String(grid.rows), cols: String(grid.cols), left: String(grid.left), top: String(grid.top), cell: String(grid.cell),
  });
  const summary = `logit difference: clean ${data.clean.toFixed(3)}, corrupted ${data.corrupt.toFixed(3)}`;
  const open = async (layer, unit) => {
    const opened = ++state.patchCell; // the last cell asked for is the one shown
    try {
      const out = await api("/api/patch/cell", { ...request, layer, unit, top: 10 });
      if (opened !== state.patchCell) return;
      $("patch-cell-title").textContent =
        `layer ${layer}, ${data.over === "layer-pos" ? "position" : "head"} ${unit} (${data.grid[layer][unit].toFixed(3)}): next tokens of the patched run`;
      canvas.dataset.selected = `${layer},${unit}`;
      renderCandidates(out.patched, $("patch-cell"), null);
      $("patch-status").textContent = summary;
    } catch (err) {
      if (opened === state.patchCell) $("patch-status").textContent = `error: ${err.message}`;
    }
  };
  canvas.onclick = (e) => {
    const hit = cellAt(canvas, grid, e);
    if (hit) open(...hit);
  };
  gridKeys(canvas, grid, open);
  $("patch-status").textContent = summary;
}

async function runPatch() {
  $("patch-status").textContent = "\u2026";
  const request = patchRequest();
  const run = ++state.patch;
  try {
    const data = await api("/api/patch", request);
    if (run !== state.patch) return; // a newer grid is on its way
    state.patchCell++; // a cell of the old grid still loading is not shown under the new one
    $("patch-cell-title").textContent = "";
    $("patch-cell").replaceChildren();
    renderPatch(data, request);
  } catch (err) {
    if (run === state.patch) $("patch-status").textContent = `error: ${err.message}`;
  }
}

async function refresh() {
  clearTimeout(state.typing); // this refresh supersedes one still waiting for typing to pause
  const generation = ++state.generation;
  const attentionRun = ++state.attention;
  const body = { prompt: prompt() };
  $("status").textContent = "\u2026";
  try {
    if (!state.info) await loadInfo(); // the page opened while the server did not answer
    const layer = Number($("layer").value || 0);
    const head = Number($("head").value || 0);
    const [next, tokens, attention, lens] = await Promise.all([
      api("/api/next", { ...body, top: 10 }),
      api("/api/tokens", body),
      api("/api/attention", { ...body, layer, head }),
      api("/api/lens", body),
    ]);
    if (generation !== state.generation) return; // a newer prompt is on its way
    state.shownIds = tokens.tokens.map((t) => t.id);
    if (state.ids) $("prompt").value = tokens.text; // the chosen tokens, decoded together
    renderCandidates(next.candidates);
    renderTokens(tokens.tokens);
    if (attentionRun === state.attention) renderAttention(attention); // else a layer or head picked since
    renderLens(lens);
    $("status").textContent = `${tokens.tokens.length} tokens`;
  } catch (err) {
    if (generation === state.generation) $("status").textContent = `error: ${err.message}`;
  }
}

async function refreshAttention() {
  const run = ++state.attention; // the last layer and head picked are the ones shown
  try {
    const data = await api("/api/attention", {
      prompt: prompt(), layer: Number($("layer").value), head: Number($("head").value),
    });
    if (run === state.attention) renderAttention(data);
  } catch (err) {
    if (run !== state.attention) return;
    $("status").textContent = `error: ${err.message}`;
    $("heatmap").classList.add("stale"); // the layer or head picked before
  }
}

// The branch history: a chip per step, {text, ids, added}; a chosen token shows its label, an
// edited prompt its end. Chips are buttons, so the keyboard reaches them too.
function renderHistory() {
  const list = $("history");
  list.replaceChildren();
  state.history.forEach((step, i) => {
    const item = document.createElement("li");
    const button = document.createElement("button");
    button.type = "button";
    // the last 16 characters, not UTF-16 units (half an emoji showed as U+FFFD), escaped as labels
    // are: a backslash doubled first, so that a typed \n does not read as a newline
    const end = Array.from(step.text).slice(-16).join("").replace(/\\/g, "\\\\").replace(/\n/g, "\\n").replace(/\t/g, "\\t");
    button.textContent = step.added !== null ? show(step.added) : `\u270e \u2026${show(end)}`;
    button.title = step.text;
    if (i === state.current) item.className = "current";
    button.addEventListener("click", () => goTo(i));
    item.append(button);
    list.append(item);
  });
}

function record(step) {
  const last = state.history[state.current];
  // the same prompt: the same ids once a token was picked (the text shown may since be their decoding)
  const same = last && (step.ids ? JSON.stringify(last.ids) === JSON.stringify(step.ids) : !last.ids && last.text === step.text);
  if (same) return; // Predict again on the same prompt is not a step (Back would seem to do nothing)
  state.history = state.history.slice(0, state.current + 1);
  state.history.push(step);
  state.current = state.history.length - 1;
  renderHistory();
}

function goTo(i) {
  state.current = i;
  $("prompt").value = state.history[i].text;
  state.ids = state.history[i].ids;
  stale();
  renderHistory();
  refresh();
}

function choose(candidate) {
  if (!state.shownIds) return; // the candidates are for an earlier prompt (a refresh is coming)
  state.ids = [...state.shownIds, candidate.id];
  stale();
  $("prompt").value += candidate.text; // until the refresh shows the ids decoded together
  record({ text: $("prompt").value, ids: state.ids, added: candidate.label });
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

// The model's name and the layer and head pickers. Failing, it is an error that refresh shows
// (and each refresh tries again), not a page whose buttons do nothing.
async function loadInfo() {
  let info;
  try {
    info = await api("/api/info");
  } catch (err) {
    throw new Error(`cannot read the model's details from the server (${err.message}); Predict tries again`);
  }
  $("model-name").textContent = `${info.model}: ${info.n_layer} layers, ${info.n_head} heads, context ${info.block_size}`;
  fillSelect($("layer"), info.n_layer);
  fillSelect($("head"), info.n_head);
  state.info = info;
}

function main() {
  $("prompt").addEventListener("input", () => {
    state.ids = null; // edited: the text is the prompt again
    state.generation++; // a refresh in flight is for the old prompt: its answer is not shown
    stale();
    clearTimeout(state.typing);
    state.typing = setTimeout(refresh, 300);
  });
  $("go").addEventListener("click", () => {
    record({ text: $("prompt").value, ids: state.ids, added: null });
    refresh();
  });
  $("back").addEventListener("click", () => {
    if (state.current > 0) goTo(state.current - 1);
  });
  $("patch-go").addEventListener("click", runPatch);
  $("layer").addEventListener("change", refreshAttention);
  $("head").addEventListener("change", refreshAttention);
  record({ text: $("prompt").value, ids: null, added: null });
  refresh();
}

main();
