// Time-series charts drawn on a <canvas>: lines, or stacked areas, over the last N seconds.
// Colours come from the stylesheet's --series-N variables, so the charts follow its theme.

function cssVar(name) {
  return getComputedStyle(document.documentElement).getPropertyValue(name).trim();
}

// A "nice" step (1, 2 or 5 times a power of ten) giving about `ticks` intervals up to `max`.
function niceStep(max, ticks) {
  const raw = max / ticks;
  const power = 10 ** Math.floor(Math.log10(raw));
  const mantissa = raw / power;
  const nice = mantissa <= 1 ? 1 : mantissa <= 2 ? 2 : mantissa <= 5 ? 5 : 10;
  return nice * power;
}

// Sizes the canvas's bitmap to its box at the screen's pixel ratio; returns a context drawing in
// CSS pixels.
function prepare(canvas) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth;
  const height = canvas.clientHeight;
  if (canvas.width !== Math.round(width * ratio) || canvas.height !== Math.round(height * ratio)) {
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);
  return { ctx, width, height };
}

// An axis label: as many decimals as the step between labels needs, and nothing after a zero.
function tickLabel(value, step, axis) {
  if (value === 0) return "0";
  if (axis === "percent") return `${Math.round(value)}%`;
  const decimals = (unitStep) => Math.max(0, -Math.floor(Math.log10(unitStep) + 1e-9));
  if (axis === "seconds") {
    if (value >= 1) return `${value.toFixed(step >= 1 ? 0 : decimals(step))} s`;
    return `${(value * 1000).toFixed(decimals(step * 1000))} ms`;
  }
  if (value >= 1000) return value.toLocaleString("en-US", { maximumFractionDigits: 0 });
  return value.toFixed(decimals(step));
}

function timeLabel(secondsAgo) {
  if (secondsAgo === 0) return "now";
  return secondsAgo % 60 === 0 ? `-${secondsAgo / 60}m` : `-${secondsAgo}s`;
}

// chart: { times: [unix s], series: [{values, color: "--series-1"}], stacked, yMax, minMax,
//          axis: "number" | "seconds" | "percent", integer, windowS }; null values leave gaps.
export function drawChart(canvas, chart) {
  const { ctx, width, height } = prepare(canvas);
  const pad = { left: 52, right: 10, top: 8, bottom: 20 };
  const plotW = width - pad.left - pad.right;
  const plotH = height - pad.top - pad.bottom;
  if (plotW <= 0 || plotH <= 0) return;
  const now = chart.times.length ? chart.times[chart.times.length - 1] : 0;
  const x = (t) => pad.left + plotW * (1 - (now - t) / chart.windowS);

  // Stacked series are drawn as cumulative sums, bottom first.
  const series = chart.series.map((s) => ({ ...s, top: s.values.slice() }));
  if (chart.stacked) {
    for (let k = 1; k < series.length; k += 1) {
      series[k].top = series[k].values.map((v, i) => (v === null ? null : v + (series[k - 1].top[i] || 0)));
    }
  }
  let max = chart.yMax || 0;
  if (!chart.yMax) {
    for (const s of series) for (const v of s.top) if (v !== null && v > max) max = v;
  }
  if (max <= 0) max = chart.minMax || 1;
  const step = chart.integer ? Math.max(1, niceStep(max, 4)) : niceStep(max, 4);
  const top = chart.yMax || Math.ceil(max / step) * step;
  const y = (v) => pad.top + plotH * (1 - v / top);

  // Grid and axes.
  const muted = cssVar("--muted");
  ctx.font = "11px system-ui, 'DejaVu Sans', sans-serif";
  ctx.strokeStyle = cssVar("--grid");
  ctx.fillStyle = muted;
  ctx.lineWidth = 1;
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  for (let v = 0; v <= top + step / 2; v += step) {
    const py = Math.round(y(v)) + 0.5;
    ctx.beginPath();
    ctx.moveTo(pad.left, py);
    ctx.lineTo(pad.left + plotW, py);
    ctx.stroke();
    ctx.fillText(tickLabel(v, step, chart.axis), pad.left - 6, py);
  }
  ctx.textAlign = "center";
  ctx.textBaseline = "top";
  const tickS = chart.windowS >= 240 ? 60 : chart.windowS >= 60 ? 30 : 10;
  for (let ago = 0; ago <= chart.windowS; ago += tickS) {
    const px = pad.left + plotW * (1 - ago / chart.windowS);
    ctx.fillText(timeLabel(ago), Math.min(Math.max(px, pad.left + 12), pad.left + plotW - 12), pad.top + plotH + 5);
  }

  // Areas (stacked) or lines; a null breaks the path.
  ctx.save();
  ctx.beginPath();
  ctx.rect(pad.left, pad.top, plotW, plotH);
  ctx.clip();
  if (chart.stacked) {
    // Each band lies between the series below it (or zero) and its own cumulative top.
    ctx.globalAlpha = 0.85;
    series.forEach((s, k) => {
      const below = k ? series[k - 1].top : null;
      const points = chart.times.map((t, i) => [t, s.top[i], below ? below[i] || 0 : 0]);
      const shown = points.filter((p) => p[1] !== null);
      if (!shown.length) return;
      ctx.fillStyle = cssVar(s.color);
      ctx.beginPath();
      shown.forEach(([t, v], i) => (i ? ctx.lineTo(x(t), y(v)) : ctx.moveTo(x(t), y(v))));
      for (let i = shown.length - 1; i >= 0; i -= 1) ctx.lineTo(x(shown[i][0]), y(shown[i][2]));
      ctx.closePath();
      ctx.fill();
    });
  }
  ctx.globalAlpha = 1;
  if (!chart.stacked) {
    for (const s of series) {
      ctx.strokeStyle = cssVar(s.color);
      ctx.lineWidth = 1.8;
      ctx.lineJoin = "round";
      ctx.beginPath();
      let pen = false;
      chart.times.forEach((t, i) => {
        const v = s.top[i];
        if (v === null) {
          pen = false;
          return;
        }
        if (pen) ctx.lineTo(x(t), y(v));
        else ctx.moveTo(x(t), y(v));
        pen = true;
      });
      ctx.stroke();
      // A lone point between gaps would be invisible as a line: mark every point when few.
      if (s.top.filter((v) => v !== null).length < 40) {
        ctx.fillStyle = ctx.strokeStyle;
        chart.times.forEach((t, i) => {
          if (s.top[i] === null) return;
          ctx.beginPath();
          ctx.arc(x(t), y(s.top[i]), 1.8, 0, 2 * Math.PI);
          ctx.fill();
        });
      }
    }
  }
  ctx.restore();
}
