package bench

import (
	"fmt"
	"image/color"
	"math"
	"os"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
)

// WritePlot draws the report to a PNG file: throughput per stage (million
// tokens/s, with the end-to-end rate), bytes through the broker (per stage,
// the pipeline's total and the raw kafka-go baseline), the distribution
// of record latency from production to batch, and the resident set size
// and end-to-end rate over the measurement window (one sample a second).
func WritePlot(rep *Report, path string) error {
	names := []string{"source"}
	vals := plotter.Values{rep.Source.TokensPerS / 1e6}
	for _, s := range rep.Stages {
		vals = append(vals, s.TokensPerS/1e6)
		names = append(names, s.Name)
	}
	tp, err := barPlot("Throughput (M tokens/s)", append(names, "e2e"), append(vals, rep.E2ETokensPerS/1e6),
		color.RGBA{R: 60, G: 110, B: 180, A: 255})
	if err != nil {
		return err
	}

	// Bytes through the broker: each stage's input, the pipeline's total
	// over all hops, and the raw kafka-go baseline of one hop.
	var mb plotter.Values
	var mbNames []string
	for _, s := range rep.Stages {
		mb = append(mb, s.InMBPerS)
		mbNames = append(mbNames, s.Name)
	}
	bp, err := barPlot(fmt.Sprintf("Through the broker (MB/s), ratio %.2f", rep.RatioToBaseline),
		append(mbNames, "pipeline", "raw kafka"), append(mb, rep.PipelineMBPerS, rep.BaselineMBPerS),
		color.RGBA{R: 90, G: 150, B: 90, A: 255})
	if err != nil {
		return err
	}

	lp := plot.New()
	lp.Title.Text = fmt.Sprintf("Latency production → batch (p50 %.0f ms, p99 %.0f ms)", rep.LatencyMS.P50, rep.LatencyMS.P99)
	lp.X.Label.Text = "ms (log)"
	lp.Y.Label.Text = "records"
	lp.X.Scale = plot.LogScale{}
	lp.X.Tick.Marker = plot.LogTicks{Prec: -1}
	pts := make(plotter.XYs, 0, len(rep.LatencyMS.Buckets))
	for i, ub := range rep.LatencyMS.Buckets {
		if ub <= 0 || math.IsInf(ub, 0) || math.IsNaN(ub) {
			continue // not on a log axis (a run whose records all took < 1 µs)
		}
		pts = append(pts, plotter.XY{X: ub, Y: float64(rep.LatencyMS.Counts[i])})
	}
	if len(pts) < 2 {
		// LogTicks needs a positive range on both ends.
		pts = append(pts, plotter.XY{X: 1, Y: 0}, plotter.XY{X: 10, Y: 0})
	}
	line, err := plotter.NewLine(pts)
	if err != nil {
		return fmt.Errorf("bench plot: %w", err)
	}
	line.Color = color.RGBA{R: 200, G: 80, B: 40, A: 255}
	line.Width = vg.Points(1.5)
	lp.Add(line)

	op, err := overTime(rep)
	if err != nil {
		return err
	}

	img := vgimg.New(vg.Points(1800), vg.Points(380))
	dc := draw.New(img)
	tiles := draw.Tiles{Rows: 1, Cols: 4, PadX: vg.Millimeter * 4, PadY: vg.Millimeter * 2, PadTop: vg.Millimeter * 2,
		PadBottom: vg.Millimeter * 2, PadLeft: vg.Millimeter * 2, PadRight: vg.Millimeter * 2}
	canvases := plot.Align([][]*plot.Plot{{tp, bp, lp, op}}, tiles, dc)
	tp.Draw(canvases[0][0])
	bp.Draw(canvases[0][1])
	lp.Draw(canvases[0][2])
	op.Draw(canvases[0][3])
	f, err := os.Create(path)
	if err != nil {
		return fmt.Errorf("bench plot: %w", err)
	}
	if _, err := (vgimg.PngCanvas{Canvas: img}).WriteTo(f); err != nil {
		f.Close()
		return fmt.Errorf("bench plot: write %s: %w", path, err)
	}
	return f.Close()
}

// overTime plots RSS (GB) and the end-to-end rate (M tokens/s) over the
// measurement window, so a long run shows whether memory stays flat.
func overTime(rep *Report) (*plot.Plot, error) {
	p := plot.New()
	p.Title.Text = fmt.Sprintf("Over the window (peak RSS %.0f MB)", rep.PeakRSSMB)
	p.X.Label.Text = "s"
	p.Y.Min = 0
	var rss, rate plotter.XYs
	var start float64
	for _, s := range rep.RSS {
		if s.Phase != "measure" {
			continue
		}
		if len(rss) == 0 {
			start = s.AtS
		}
		rss = append(rss, plotter.XY{X: s.AtS - start, Y: s.MB / 1024})
		rate = append(rate, plotter.XY{X: s.AtS - start, Y: s.TokensPerS / 1e6})
	}
	if len(rss) == 0 {
		rss = append(rss, plotter.XY{})
		rate = append(rate, plotter.XY{})
	}
	for _, l := range []struct {
		name string
		pts  plotter.XYs
		c    color.RGBA
	}{
		{"RSS (GB)", rss, color.RGBA{R: 120, G: 60, B: 160, A: 255}},
		{"end to end (M tokens/s)", rate, color.RGBA{R: 60, G: 110, B: 180, A: 255}},
	} {
		line, err := plotter.NewLine(l.pts)
		if err != nil {
			return nil, fmt.Errorf("bench plot: %w", err)
		}
		line.Color = l.c
		line.Width = vg.Points(1.5)
		p.Add(line)
		p.Legend.Add(l.name, line)
	}
	p.Legend.Top = true
	p.Legend.Left = true
	return p, nil
}

// barPlot is a bar chart of vals, one bar per name, from zero.
func barPlot(title string, names []string, vals plotter.Values, c color.RGBA) (*plot.Plot, error) {
	p := plot.New()
	p.Title.Text = title
	bars, err := plotter.NewBarChart(vals, vg.Points(24))
	if err != nil {
		return nil, fmt.Errorf("bench plot: %w", err)
	}
	bars.Color = c
	bars.LineStyle.Width = 0
	p.Add(bars)
	p.NominalX(names...)
	p.Y.Min = 0
	return p, nil
}
