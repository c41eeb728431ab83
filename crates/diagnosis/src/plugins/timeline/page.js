"use strict";
// The timeline page of `insight report timeline -o FILE.html`: a row per
// thread (running, lock waits and holds nested by depth, samples), a CPU row,
// a time axis; wheel zooms, drag pans, hover shows details. Slices narrower
// than a pixel are aggregated into one-pixel columns, so drawing costs the
// visible pixels, not the events.
(function () {
  const D = JSON.parse(document.getElementById("data").textContent);
  const KIND = ["wait", "hold", "failed", "condwait", "barrier", "semwait"];
  const COLOR = {
    wait: "#e55", hold: "#47c", failed: "#e9a23b", condwait: "#a77bca", barrier: "#8d6e63",
    semwait: "#26a69a", run: "#6a6", sample: "#222",
  };
  const LEVEL = 11, RUN = 5, SAMPLE = 4, MAX_LEVELS = 6;
  const rows = D.threads.map((t) => ({ thread: t, slices: [], runs: [], samples: [], instants: [], levels: 1 }));
  const cpu = { runs: [] };
  for (const s of D.slices) {
    const r = rows[s[0]];
    r.slices.push(s);
    r.levels = Math.max(r.levels, Math.min(MAX_LEVELS, s[6] + 1));
  }
  for (const r of D.runs) {
    cpu.runs.push(r);
    if (r[0] >= 0) rows[r[0]].runs.push(r);
  }
  for (const s of D.samples) if (s[0] >= 0) rows[s[0]].samples.push(s);
  for (const e of D.instants) if (e[0] >= 0) rows[e[0]].instants.push(e);
  // Each row's slices in start order, for the search on hover, and by
  // level for drawing: nested ones, then a thread's extra lanes, below.
  for (const r of rows) {
    r.slices.sort((a, b) => a[3] - b[3]);
    r.byLevel = new Map();
    for (const s of r.slices) {
      const level = Math.min(MAX_LEVELS - 1, s[6]);
      if (!r.byLevel.has(level)) r.byLevel.set(level, []);
      r.byLevel.get(level).push(s);
    }
  }

  let t0 = 0, t1 = Math.max(1, D.span), lockFilter = -1;
  const ms = (ns) => (ns / 1e6).toFixed(3) + " ms";
  const at = (ns) => ms(ns + D.origin);

  document.getElementById("summary").textContent =
    `${D.threads.length} threads, ${D.slices.length} lock slices, ${D.runs.length} runs, ` +
    `${D.samples.length} samples; guest time ${at(0)} to ${at(D.span)}`;
  const select = document.getElementById("lock");
  D.locks.forEach((name, i) => {
    const o = document.createElement("option");
    o.value = i;
    o.textContent = name;
    select.appendChild(o);
  });
  select.onchange = () => { lockFilter = +select.value; redraw(); };
  document.getElementById("reset").onclick = () => { t0 = 0; t1 = Math.max(1, D.span); redraw(); };

  // The rows in the document: the CPU first, then one per thread.
  const container = document.getElementById("rows");
  function makeRow(label, cls, height, model) {
    const div = document.createElement("div");
    div.className = "row " + cls;
    const name = document.createElement("div");
    name.className = "label";
    name.textContent = label;
    name.title = label;
    const canvas = document.createElement("canvas");
    canvas.height = height;
    canvas.style.height = height + "px";
    div.append(name, canvas);
    container.appendChild(div);
    model.canvas = canvas;
    attach(canvas, model);
    return model;
  }
  makeRow("CPU (what ran)", "cpu", 14, cpu);
  rows.forEach((r, i) => {
    const div = makeRow(`${r.thread.name} (pid ${r.thread.pid})`, "thread", RUN + r.levels * LEVEL + SAMPLE + 3, r);
    div.canvas.parentElement.dataset.row = i;
  });
  const axis = document.querySelector("#axis canvas");
  axis.height = 18;

  const xOf = (t, w) => ((t - t0) / (t1 - t0)) * w;
  const tOf = (x, w) => t0 + (x / w) * (t1 - t0);

  function size(canvas) {
    const w = canvas.clientWidth || 800;
    if (canvas.width !== w) canvas.width = w;
    return w;
  }

  // Draws intervals [start, end] of `list` (fields at i0, i1) in one color
  // per item, aggregating those under a pixel into columns.
  function intervals(ctx, w, list, i0, i1, y, h, color) {
    const columns = new Map();
    for (const s of list) {
      if (s[i1] < t0 || s[i0] > t1) continue;
      const a = xOf(s[i0], w), b = xOf(s[i1], w);
      const c = color(s);
      if (b - a < 1) {
        const px = Math.floor(a);
        if (!columns.has(px)) columns.set(px, c);
      } else {
        ctx.fillStyle = c;
        ctx.fillRect(a, y, Math.max(1, b - a), h);
      }
    }
    for (const [px, c] of columns) {
      ctx.fillStyle = c;
      ctx.fillRect(px, y, 1, h);
    }
  }

  // A run on the CPU row: a shade of the running colour for a thread with
  // a row of its own, of grey for another task (/init, a shell, a kernel
  // thread), never a hue of the waits and holds.
  function taskColor(run) {
    const name = run[3] || "task";
    let h = 0;
    for (let i = 0; i < name.length; i++) h = (h * 31 + name.charCodeAt(i)) >>> 0;
    return run[0] >= 0 ? `hsl(${100 + (h % 40)},40%,${38 + ((h >>> 8) % 22)}%)`
      : `hsl(0,0%,${52 + ((h >>> 8) % 28)}%)`;
  }

  function drawRow(r) {
    const c = r.canvas, w = size(c), ctx = c.getContext("2d");
    ctx.clearRect(0, 0, w, c.height);
    intervals(ctx, w, r.runs, 1, 2, 0, RUN, () => COLOR.run);
    for (const [level, list] of r.byLevel) {
      intervals(ctx, w, list, 3, 4, RUN + 1 + level * LEVEL, LEVEL - 2, (s) =>
        lockFilter < 0 || s[2] === lockFilter ? COLOR[KIND[s[1]]] : "#ddd");
    }
    ctx.fillStyle = COLOR.sample;
    const ys = c.height - SAMPLE;
    let last = -1;
    for (const s of r.samples) {
      if (s[1] < t0 || s[1] > t1) continue;
      const x = Math.floor(xOf(s[1], w));
      if (x !== last) ctx.fillRect(x, ys, 1, SAMPLE);
      last = x;
    }
    ctx.fillStyle = "#000";
    for (const e of r.instants) {
      if (e[2] < t0 || e[2] > t1) continue;
      const x = xOf(e[2], w);
      ctx.fillRect(x - 1, 0, 2, c.height);
    }
  }

  function drawCpu() {
    const c = cpu.canvas, w = size(c), ctx = c.getContext("2d");
    ctx.clearRect(0, 0, w, c.height);
    intervals(ctx, w, cpu.runs, 1, 2, 1, c.height - 2, taskColor);
  }

  function drawAxis() {
    const w = size(axis), ctx = axis.getContext("2d");
    ctx.clearRect(0, 0, w, axis.height);
    ctx.fillStyle = "#444";
    ctx.font = "11px sans-serif";
    const span = t1 - t0;
    let step = Math.pow(10, Math.floor(Math.log10(span / 5)));
    if (span / step > 10) step *= 2;
    if (span / step > 10) step *= 2.5;
    // Ticks at round values of the guest's clock, not of the window.
    for (let a = Math.ceil((t0 + D.origin) / step) * step; a <= t1 + D.origin; a += step) {
      const t = a - D.origin, x = xOf(t, w);
      ctx.fillRect(x, 12, 1, 6);
      ctx.fillText(at(t), x + 2, 10);
    }
  }

  // Interactions ask for a drawing; one is made per frame at most.
  let pending = false;
  function redraw() {
    if (pending) return;
    pending = true;
    requestAnimationFrame(() => { pending = false; draw(); });
  }

  function draw() {
    const start = performance.now();
    drawAxis();
    drawCpu();
    rows.forEach(drawRow);
    // How long a whole redraw takes, for whoever measures the page.
    document.body.dataset.drawMs = (performance.now() - start).toFixed(1);
  }

  // Hover: what lies under the pointer.
  const tip = document.getElementById("tip");
  function describe(model, x, y, w) {
    const t = tOf(x, w);
    const slop = (t1 - t0) / w * 2;
    if (model === cpu) {
      const r = cpu.runs.find((r) => r[1] <= t + slop && r[2] >= t - slop);
      return r && `${r[3] || "task"} on the CPU\n${at(r[1])} for ${ms(r[2] - r[1])}`;
    }
    if (y < RUN) {
      const r = model.runs.find((r) => r[1] <= t + slop && r[2] >= t - slop);
      return r && `running\n${at(r[1])} for ${ms(r[2] - r[1])}`;
    }
    if (y >= model.canvas.height - SAMPLE - 1) {
      const s = model.samples.find((s) => Math.abs(s[1] - t) <= slop);
      if (s) return `sample in ${D.functions[s[2]]} at ${at(s[1])}` + stack(s[3]);
    }
    const level = Math.floor((y - RUN - 1) / LEVEL);
    let best = null;
    for (const s of model.slices) {
      if (s[3] > t + slop) break;
      if (s[4] >= t - slop && Math.min(MAX_LEVELS - 1, s[6]) === level) best = s;
    }
    if (!best) return null;
    const what = {
      wait: "waiting for", hold: "holding", failed: "failed to take",
      condwait: "waiting on condition variable", barrier: "waiting at barrier",
      semwait: "waiting on semaphore",
    }[KIND[best[1]]];
    let text = `${what} ${D.locks[best[2]]}\n${at(best[3])} for ${ms(best[4] - best[3])}`;
    if (best[8]) text += " (still open when the events end)";
    if (best[7] >= 0) text += `\nwoken by ${D.threads[best[7]].name}'s release`;
    return text + stack(best[5]);
  }
  function stack(id) {
    if (id < 0) return "";
    return "\nrequested at:\n" + D.stacks[id].map((f, i) => `  #${i} ${f}`).join("\n");
  }

  let drag = null;
  function attach(canvas, model) {
    canvas.addEventListener("wheel", (e) => {
      e.preventDefault();
      const w = canvas.clientWidth, t = tOf(e.offsetX, w);
      const f = e.deltaY > 0 ? 1.25 : 0.8;
      const span = Math.max(1000, (t1 - t0) * f);
      t0 = t - (e.offsetX / w) * span;
      t1 = t0 + span;
      redraw();
    }, { passive: false });
    canvas.addEventListener("mousedown", (e) => { drag = { x: e.clientX, t0, t1, w: canvas.clientWidth }; });
    canvas.addEventListener("dblclick", () => { t0 = 0; t1 = Math.max(1, D.span); redraw(); });
    canvas.addEventListener("mousemove", (e) => {
      if (drag) return;
      const text = describe(model, e.offsetX, e.offsetY, canvas.clientWidth);
      tip.hidden = !text;
      if (text) {
        tip.textContent = text;
        tip.style.left = Math.min(e.clientX + 12, window.innerWidth - tip.offsetWidth - 4) + "px";
        tip.style.top = e.clientY + 14 + "px";
      }
    });
    canvas.addEventListener("mouseleave", () => { tip.hidden = true; });
  }
  window.addEventListener("mousemove", (e) => {
    if (!drag) return;
    const dt = ((e.clientX - drag.x) / drag.w) * (drag.t1 - drag.t0);
    t0 = drag.t0 - dt;
    t1 = drag.t1 - dt;
    redraw();
  });
  window.addEventListener("mouseup", () => { drag = null; });
  window.addEventListener("resize", redraw);
  draw();
})();
