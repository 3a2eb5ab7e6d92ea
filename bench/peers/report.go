package peers

import (
	"fmt"
	"image/color"
	"io"
	"os"
	"slices"
	"sort"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
)

// WriteTable writes every row (measurement runs, then kill runs) and the
// ratios of each round.
func (res *Result) WriteTable(w io.Writer) error {
	var b strings.Builder
	p := func(f string, a ...any) { fmt.Fprintf(&b, f, a...) }
	p("machine: %s\nstarted: %s UTC, window %.0f s per run, %d groups in flight, corpus %s\n\n", res.Machine,
		res.Started.Format("2006-01-02 15:04"), res.Duration, res.InFlight, res.Corpus)
	p("| round | system | hops | policy tokens/s | MB/s | p50 / p99 ms | cores | CPU-s per M policy tokens | policy tokens per CPU-s | MB per CPU-s | peak RSS MB | lost / launched attempts | load avg |\n")
	p("|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
	for _, r := range res.Rows {
		round := fmt.Sprint(r.Round)
		if r.Kill {
			round = "kill"
		}
		lat, lost, peak := "—", "—", "—"
		if r.P50MS > 0 {
			lat = fmt.Sprintf("%.0f / %.0f", r.P50MS, r.P99MS)
		}
		if r.Lost >= 0 {
			lost = fmt.Sprintf("%d / %d", r.Lost, r.Launched)
			if r.Duplicated > 0 {
				lost += fmt.Sprintf(" (+%d dup)", r.Duplicated)
			}
		}
		if r.PeakMB > 0 && r.Hops > 1 {
			peak = fmt.Sprintf("%.0f", r.PeakMB)
		}
		p("| %s | %s | %d | %s | %.0f | %s | %.2f | %.3f | %s | %.0f | %s | %s | %.1f |\n", round, r.System, r.Hops,
			human(r.PolicyTokensPerS), r.MBPerS, lat, r.CPUCores, r.CPUSPerMPolicy, human(r.PolicyTokensPerCPUS), r.MBPerCPUS,
			peak, lost, r.LoadAvg[0])
	}
	p("\n")
	for _, line := range res.Ratios() {
		p("%s\n", line)
	}
	for _, r := range res.Rows {
		if r.Note != "" && r.Kill {
			p("kill run, %s: %s\n", r.System, r.Note)
		}
	}
	_, err := io.WriteString(w, b.String())
	return err
}

// Ratios are the comparisons the table ends with, per round: trajflow's
// bytes per CPU-second over raw kafka-go's (same run, same broker), and
// trajflow's policy tokens per CPU-second and peak RSS over each peer's in
// the same round. With more than one round, a line per comparison then
// gives the per-CPU-second ratio's median and range over the rounds: on a
// shared machine one round's ratio is one draw (bench/RESULTS.md).
func (res *Result) Ratios() []string {
	var out []string
	var spread ratioSpread
	rounds := map[int][]Row{}
	var keys []int
	for _, r := range res.Rows {
		if r.Kill {
			continue
		}
		if _, ok := rounds[r.Round]; !ok {
			keys = append(keys, r.Round)
		}
		rounds[r.Round] = append(rounds[r.Round], r)
	}
	sort.Ints(keys)
	find := func(rows []Row, prefix string) *Row {
		for i := range rows {
			if strings.HasPrefix(rows[i].System, prefix) {
				return &rows[i]
			}
		}
		return nil
	}
	for _, k := range keys {
		rows := rounds[k]
		for _, where := range []string{"embedded broker", "Apache Kafka"} {
			tf := find(rows, "trajflow ("+where)
			kg := find(rows, "raw kafka-go ("+where)
			fg := find(rows, "raw franz-go ("+where)
			if tf == nil || kg == nil {
				continue
			}
			line := fmt.Sprintf("round %d, %s: trajflow / raw kafka-go  MB per CPU-s %.2f, MB/s %.2f", k, where, tf.MBPerCPUS/kg.MBPerCPUS, tf.MBPerS/kg.MBPerS)
			if fg != nil {
				line += fmt.Sprintf("; trajflow / raw franz-go  MB per CPU-s %.2f, MB/s %.2f", tf.MBPerCPUS/fg.MBPerCPUS, tf.MBPerS/fg.MBPerS)
			}
			out = append(out, line)
			spread.add("trajflow / raw kafka-go ("+where+")  MB per CPU-s", tf.MBPerCPUS/kg.MBPerCPUS)
		}
		tf := find(rows, "trajflow (embedded")
		for _, peer := range []struct{ prefix, label string }{{"Ray", "Ray"}, {"ZeroMQ + msgpack", "ZeroMQ"}, {ZeroMQGoName, "ZeroMQ in Go"}, {ZeroMQLibzmqName, "ZeroMQ in Go on libzmq"}, {FilesName, "files"}} {
			pr := find(rows, peer.prefix)
			if tf == nil || pr == nil || pr.PolicyTokensPerCPUS == 0 {
				continue
			}
			out = append(out, fmt.Sprintf("round %d: trajflow / %s  policy tokens per CPU-s %.2f, per wall second %.2f, peak RSS %.2f",
				k, peer.label, tf.PolicyTokensPerCPUS/pr.PolicyTokensPerCPUS, tf.PolicyTokensPerS/pr.PolicyTokensPerS, tf.PeakMB/max(pr.PeakMB, 1)))
			spread.add("trajflow / "+peer.label+"  policy tokens per CPU-s", tf.PolicyTokensPerCPUS/pr.PolicyTokensPerCPUS)
		}
	}
	return append(out, spread.lines()...)
}

// ratioSpread collects one ratio per round under each label, in the order
// the labels first come.
type ratioSpread struct {
	labels []string
	values map[string][]float64
}

func (s *ratioSpread) add(label string, v float64) {
	if s.values == nil {
		s.values = map[string][]float64{}
	}
	if _, ok := s.values[label]; !ok {
		s.labels = append(s.labels, label)
	}
	s.values[label] = append(s.values[label], v)
}

// lines gives "over N rounds: LABEL median M (min–max)" for every label
// with more than one round.
func (s *ratioSpread) lines() []string {
	var out []string
	for _, label := range s.labels {
		v := slices.Clone(s.values[label])
		if len(v) < 2 {
			continue
		}
		slices.Sort(v)
		med := v[len(v)/2]
		if len(v)%2 == 0 {
			med = (v[len(v)/2-1] + v[len(v)/2]) / 2
		}
		out = append(out, fmt.Sprintf("over %d rounds: %s median %.2f (%.2f–%.2f)", len(v), label, med, v[0], v[len(v)-1]))
	}
	return out
}

func human(v float64) string {
	switch {
	case v >= 1e6:
		return fmt.Sprintf("%.2f M", v/1e6)
	case v >= 1e3:
		return fmt.Sprintf("%.0f k", v/1e3)
	}
	return fmt.Sprintf("%.0f", v)
}

// WritePlot draws every system of the measurement runs on one chart:
// policy tokens per CPU-second, MB per CPU-second and peak RSS (the mean
// over the rounds, one bar per system).
func (res *Result) WritePlot(path string) error {
	type agg struct {
		tok, mb, rss float64
		n            int
	}
	var names []string
	by := map[string]*agg{}
	for _, r := range res.Rows {
		if r.Kill {
			continue
		}
		a, ok := by[r.System]
		if !ok {
			a = &agg{}
			by[r.System] = a
			names = append(names, r.System)
		}
		a.mb += r.MBPerCPUS
		if r.Hops > 1 { // a raw client's one hop carries no pipeline's tokens
			a.tok += r.PolicyTokensPerCPUS / 1e6
			a.rss += r.PeakMB
		}
		a.n++
	}
	if len(names) == 0 {
		return fmt.Errorf("peers plot: no rows")
	}
	labels := make([]string, len(names))
	tok, mb, rss := make(plotter.Values, len(names)), make(plotter.Values, len(names)), make(plotter.Values, len(names))
	for i, n := range names {
		a := by[n]
		labels[i] = shortName(n)
		tok[i], mb[i], rss[i] = a.tok/float64(a.n), a.mb/float64(a.n), a.rss/float64(a.n)
	}
	var plots []*plot.Plot
	for _, c := range []struct {
		title string
		vals  plotter.Values
		col   color.RGBA
	}{
		{"Policy tokens per CPU-second (M), 5-hop systems", tok, color.RGBA{R: 60, G: 110, B: 180, A: 255}},
		{"MB moved per CPU-second (all hops)", mb, color.RGBA{R: 90, G: 150, B: 90, A: 255}},
		{"Peak memory in the window (MB), 5-hop systems", rss, color.RGBA{R: 120, G: 60, B: 160, A: 255}},
	} {
		pl := plot.New()
		pl.Title.Text = c.title
		bars, err := plotter.NewBarChart(c.vals, vg.Points(20))
		if err != nil {
			return fmt.Errorf("peers plot: %w", err)
		}
		bars.Color = c.col
		bars.LineStyle.Width = 0
		pl.Add(bars)
		pl.NominalX(labels...)
		pl.X.Tick.Label.Rotation = 0.5
		pl.X.Tick.Label.XAlign = draw.XRight
		pl.Y.Min = 0
		// Headroom, so that the tallest bar stays clear of the title.
		if len(c.vals) > 0 {
			pl.Y.Max = max(pl.Y.Max, 1.08*slices.Max(c.vals))
		}
		plots = append(plots, pl)
	}
	img := vgimg.New(vg.Points(1500), vg.Points(460))
	dc := draw.New(img)
	// The x labels are rotated and right-aligned under their bars: the
	// first one reaches left of its plot by most of its length, which
	// PadLeft and PadX leave room for.
	tiles := draw.Tiles{Rows: 1, Cols: len(plots), PadX: vg.Millimeter * 14, PadY: vg.Millimeter * 2, PadTop: vg.Millimeter * 2,
		PadBottom: vg.Millimeter * 2, PadLeft: vg.Millimeter * 40, PadRight: vg.Millimeter * 2}
	canvases := plot.Align([][]*plot.Plot{plots}, tiles, dc)
	for i, pl := range plots {
		pl.Draw(canvases[0][i])
	}
	f, err := os.Create(path)
	if err != nil {
		return fmt.Errorf("peers plot: %w", err)
	}
	if _, err := (vgimg.PngCanvas{Canvas: img}).WriteTo(f); err != nil {
		f.Close()
		return fmt.Errorf("peers plot: write %s: %w", path, err)
	}
	return f.Close()
}

// shortName is a system's label on the chart.
func shortName(s string) string {
	r := strings.NewReplacer("embedded broker", "embedded", "Apache Kafka", "Kafka", " (its JVM's CPU counted)", "",
		"actors, object store, ", "", "ZeroMQ + msgpack (processes)", "ZeroMQ+msgpack", ZeroMQGoName, "ZeroMQ Go", ZeroMQLibzmqName, "ZeroMQ libzmq", FilesName, "files+msgpack")
	return r.Replace(s)
}
