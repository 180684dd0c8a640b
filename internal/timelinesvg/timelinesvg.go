// Package timelinesvg draws the timeline of node failures and their recoveries as a standalone SVG:
// per failure a title with its id and outcome, the hosts involved, the bytes replayed and verified, and
// each recovery stage as a bar on a time axis in seconds from the failure's declaration.
//
// It is pure code over plain types (no agent internals), so it is tested without a cluster. The text it
// draws comes from other nodes (stage details, errors, names): every string is clipped and XML-escaped,
// and the picture uses no scripts, stylesheets, external fonts or links, so it is safe to open anywhere.
// The output is a function of the input alone: the same failures give the same bytes.
package timelinesvg

import (
	"bytes"
	"encoding/xml"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"
)

// A Failure is one node failure and its recovery as the picture shows it.
type Failure struct {
	ID       string
	Outcome  Outcome
	Node     string // the failed node
	Detector string // the node that declared the failure and coordinated the recovery
	Target   string // where the jobs were restored: a spare, or the detector itself in basic mode
	Basic    bool   // restored on the detector because no spare was free
	Jobs     []string
	// Origin is the time axis' zero: when the failure was declared. Zero: the earliest stage start.
	Origin time.Time
	// Now ends the bars of stages still under way. Zero: they end at the latest time the failure shows.
	Now    time.Time
	Stages []Stage
	// StagesDropped counts stages the failure log left out (a recovery of very many jobs).
	StagesDropped int
	Error         string
}

// Outcome is where a recovery stands.
type Outcome int

const (
	Recovering Outcome = iota
	Recovered
	NotRecovered
)

func (o Outcome) String() string {
	switch o {
	case Recovered:
		return "recovered"
	case NotRecovered:
		return "NOT RECOVERED"
	default:
		return "recovering"
	}
}

// A Stage is one step of a recovery.
type Stage struct {
	Name   string
	Job    string
	Host   string
	Start  time.Time
	End    time.Time // zero (or before Start): the stage is still under way
	Detail string
	Error  string
}

// Ongoing says whether the stage has not ended yet.
func (s Stage) Ongoing() bool { return s.End.IsZero() || s.End.Before(s.Start) }

// Geometry of the picture, in SVG user units (pixels at 100% zoom).
const (
	Width       = 1000
	labelX      = 16  // left edge of the stage labels
	barX        = 260 // left edge of the time axis
	barW        = Width - barX - 24
	rowH        = 38 // one stage: its bar and, below it, its detail
	barH        = 16
	barDY       = 2  // the bar's top below its row's
	headerH     = 96 // title and the lines under it, before the axis
	axisH       = 26 // the axis' tick labels
	footerLineH = 16
	panelGap    = 24  // between two failures
	textMax     = 110 // characters of a detail, error or jobs line
	nameMax     = 32  // characters of a host, job or stage name
)

// ErrorColour fills a stage that failed.
const ErrorColour = "#d62728"

// Colour is the fill of a stage's bar: one per stage name (the agent's Stage* constants), grey for
// others, red for a stage that failed.
func Colour(s Stage) string {
	if s.Error != "" {
		return ErrorColour
	}
	switch s.Name {
	case "detected":
		return "#d9822b"
	case "spare claimed":
		return "#8e6bbf"
	case "fenced":
		return "#b5477d"
	case "self-fenced":
		return "#7d3c98"
	case "snapshot fetched":
		return "#2b7bd9"
	case "images rewritten":
		return "#1f9e89"
	case "restored":
		return "#3aa84a"
	case "replay done":
		return "#c2a319"
	case "re-protected":
		return "#5c6f82"
	}
	return "#8a8a8a"
}

// colour is the outcome's text colour.
func (o Outcome) colour() string {
	switch o {
	case Recovered:
		return "#1a7f37"
	case NotRecovered:
		return ErrorColour
	}
	return "#9a6700"
}

// A bar is a stage's place on the axis.
type bar struct {
	X, W float64 // in user units; W is at least minBarW so that an instant stage stays visible
	From float64 // seconds from the origin
	Secs float64 // duration in seconds (up to the axis' end for an ongoing stage)
}

const minBarW = 2

// axis maps times to x: [Min, Max] seconds from the origin onto [barX, barX+barW].
type axis struct {
	Min, Max float64
}

func (a axis) x(sec float64) float64 {
	return barX + (sec-a.Min)/(a.Max-a.Min)*barW
}

// secs is t in seconds from origin.
func secs(t, origin time.Time) float64 { return t.Sub(origin).Seconds() }

// origin is the failure's zero time.
func (f *Failure) origin() time.Time {
	if !f.Origin.IsZero() {
		return f.Origin
	}
	var o time.Time
	for _, s := range f.Stages {
		if o.IsZero() || s.Start.Before(o) {
			o = s.Start
		}
	}
	return o
}

// end is where ongoing stages end: Now, or the latest time the failure shows.
func (f *Failure) end(origin time.Time) float64 {
	if !f.Now.IsZero() {
		return secs(f.Now, origin)
	}
	e := 0.0
	for _, s := range f.Stages {
		e = math.Max(e, secs(s.Start, origin))
		if !s.Ongoing() {
			e = math.Max(e, secs(s.End, origin))
		}
	}
	return e
}

// layout places the stages on one axis that spans the origin and every stage.
func layout(f *Failure) (axis, []bar) {
	o := f.origin()
	end := f.end(o)
	ax := axis{Min: 0, Max: end}
	type span struct{ from, to float64 }
	spans := make([]span, len(f.Stages))
	for i, s := range f.Stages {
		sp := span{from: secs(s.Start, o), to: end}
		if !s.Ongoing() {
			sp.to = secs(s.End, o)
		}
		sp.to = math.Max(sp.to, sp.from)
		spans[i] = sp
		ax.Min, ax.Max = math.Min(ax.Min, sp.from), math.Max(ax.Max, sp.to)
	}
	if ax.Max-ax.Min < 1e-3 {
		ax.Max = ax.Min + 1 // nothing has a duration yet: a one-second axis
	}
	// The end is rounded up to a tick; the start stays where the earliest stage starts (at most 0), so
	// that the time before the declaration takes no more room than it needs.
	ax.Max = niceCeil(ax.Max, ax.Max-ax.Min)
	bars := make([]bar, len(spans))
	for i, sp := range spans {
		x0, x1 := ax.x(sp.from), ax.x(sp.to)
		bars[i] = bar{X: x0, W: math.Max(x1-x0, minBarW), From: sp.from, Secs: sp.to - sp.from}
	}
	return ax, bars
}

// tickStep is a 1, 2 or 5 times a power of ten that cuts span into at most 10 steps.
func tickStep(span float64) float64 {
	if !(span > 0) || math.IsInf(span, 0) {
		return 1
	}
	step := math.Pow(10, math.Floor(math.Log10(span/10)))
	for _, m := range []float64{1, 2, 5, 10} {
		if span/(step*m) <= 10 {
			return step * m
		}
	}
	return step * 10
}

func niceCeil(v, span float64) float64 { s := tickStep(span); return math.Ceil(v/s) * s }

// ticks are the axis' labelled times.
func ticks(ax axis) []float64 {
	step := tickStep(ax.Max - ax.Min)
	var ts []float64
	for i := math.Ceil(ax.Min/step - 1e-9); len(ts) <= 20; i++ {
		t := i * step
		if t > ax.Max+step*1e-6 {
			break
		}
		ts = append(ts, t)
	}
	return ts
}

// rowTop is the top of stage i's row in a panel that starts at y; its bar starts barDY lower.
func rowTop(y float64, i int) float64 { return y + headerH + axisH + float64(i)*rowH }

// Render draws the failures one under the other, in the order given.
func Render(fs []Failure) []byte {
	var body bytes.Buffer
	y := 0.0
	for i := range fs {
		if i > 0 {
			y += panelGap
			fmt.Fprintf(&body, `<line x1="0" y1="%s" x2="%d" y2="%s" stroke="#cccccc"/>`+"\n", num(y-panelGap/2), Width, num(y-panelGap/2))
		}
		y = panel(&body, &fs[i], y)
	}
	if len(fs) == 0 {
		fmt.Fprintf(&body, `<text x="%d" y="32" font-size="16">no failures</text>`+"\n", labelX)
		y = 56
	}
	var out bytes.Buffer
	h := int(math.Ceil(y))
	fmt.Fprintf(&out, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="sans-serif" font-size="12">`+"\n", Width, h, Width, h)
	fmt.Fprintf(&out, `<title>ftkit recovery timeline</title>`+"\n")
	fmt.Fprintf(&out, `<rect x="0" y="0" width="%d" height="%d" fill="#ffffff"/>`+"\n", Width, h)
	out.Write(body.Bytes())
	out.WriteString("</svg>\n")
	return out.Bytes()
}

// panel draws one failure from y down and returns where it ends.
func panel(b *bytes.Buffer, f *Failure, y float64) float64 {
	text(b, labelX, y+26, `font-size="18" font-weight="bold"`, "failure "+clip(f.ID, nameMax*2))
	text(b, Width-24, y+26, `text-anchor="end" font-size="18" font-weight="bold" fill="`+f.Outcome.colour()+`"`, f.Outcome.String())
	where := "restored on spare " + clip(f.Target, nameMax)
	if f.Basic {
		where = "restored on " + clip(f.Target, nameMax) + " (basic mode: no spare was free)"
	}
	if f.Target == "" {
		where = "no restore target yet"
	}
	text(b, labelX, y+46, `font-size="13"`, "failed node "+clip(f.Node, nameMax)+" · detected by "+clip(f.Detector, nameMax)+" · "+where)
	jobs := fmt.Sprintf("%d job(s)", len(f.Jobs))
	if len(f.Jobs) > 0 {
		jobs += ": " + strings.Join(f.Jobs, ", ")
	}
	text(b, labelX, y+66, `font-size="12" fill="#444444"`, clip(jobs, textMax+20))
	text(b, labelX, y+84, `font-size="12" fill="#444444"`, bytesLine(f.Stages))

	ax, bars := layout(f)
	top := y + headerH
	// Axis: a tick line and label per step, and the origin (the declaration) in bold.
	bottom := top + axisH + float64(len(f.Stages))*rowH
	for _, t := range ticks(ax) {
		x := ax.x(t)
		stroke := `stroke="#e0e0e0"`
		if t == 0 {
			stroke = `stroke="#555555" stroke-dasharray="4 3"`
		}
		fmt.Fprintf(b, `<line x1="%s" y1="%s" x2="%s" y2="%s" %s/>`+"\n", num(x), num(top+axisH-6), num(x), num(bottom), stroke)
		text(b, x, top+axisH-10, `text-anchor="middle" fill="#555555"`, fmtSecs(t)+" s")
	}
	text(b, labelX, top+axisH-10, `fill="#555555"`, "seconds from declaration")
	for i, s := range f.Stages {
		bar := bars[i]
		ry := rowTop(y, i)
		label := clip(s.Name, nameMax)
		if s.Job != "" {
			label += " · " + clip(s.Job, nameMax)
		}
		text(b, labelX, ry+13, `font-weight="bold"`, label)
		text(b, labelX, ry+28, `font-size="11" fill="#555555"`, "on "+clip(s.Host, nameMax))
		extra := ""
		if s.Ongoing() {
			extra = ` fill-opacity="0.45" stroke="#333333" stroke-dasharray="3 2"`
		}
		fmt.Fprintf(b, `<rect x="%s" y="%s" width="%s" height="%d" rx="2" fill="%s"%s><title>%s</title></rect>`+"\n",
			num(bar.X), num(ry+barDY), num(bar.W), barH, Colour(s), extra, esc(clip(s.Name+": "+s.Detail, textMax*2)))
		dur := fmtDur(bar.Secs)
		if s.Ongoing() {
			dur += " so far (under way)"
		}
		// The duration right of the bar, or left of it when the bar reaches the axis' end.
		if bar.X+bar.W+5+textWidth(dur, 12) <= Width {
			text(b, bar.X+bar.W+5, ry+14, ``, dur)
		} else {
			text(b, bar.X-5, ry+14, `text-anchor="end"`, dur)
		}
		note, attrs := s.Detail, `font-size="11" fill="#444444"`
		if s.Error != "" {
			note, attrs = "error: "+s.Error, `font-size="11" fill="`+ErrorColour+`"`
		}
		if note != "" {
			// Under the bar from the axis' left edge: a detail is wider than most bars.
			text(b, barX, ry+31, attrs, clip(note, textMax))
		}
	}
	y = bottom + 8
	if f.StagesDropped > 0 {
		y += footerLineH
		text(b, labelX, y, `font-size="11" fill="#555555"`, fmt.Sprintf("%d stage(s) between the first and the newest are not shown (the failure log keeps a bounded number)", f.StagesDropped))
	}
	if f.Error != "" {
		y += footerLineH
		text(b, labelX, y, `font-size="12" fill="`+ErrorColour+`"`, clip("error: "+f.Error, textMax+20))
	}
	return y + 8
}

// bytesLine sums what the stages' details say was replayed and verified.
func bytesLine(stages []Stage) string {
	var sum Bytes
	for _, s := range stages {
		sum = sum.Add(ParseDetail(s.Detail))
	}
	if !sum.HasInjected && !sum.HasResent && !sum.HasVerified {
		return "bytes replayed: not recorded by these stages"
	}
	var parts []string
	if sum.HasInjected {
		parts = append(parts, "bytes replayed from the peers' logs: "+humanBytes(sum.Injected))
	}
	if sum.HasResent {
		parts = append(parts, "re-sent by the job: "+humanBytes(sum.Resent))
	}
	if sum.HasVerified {
		parts = append(parts, fmt.Sprintf("verified: %s on %d connection(s)", humanBytes(sum.Verified), sum.Conns))
	}
	return strings.Join(parts, " · ")
}

func humanBytes(n int64) string {
	switch {
	case n >= 10<<20:
		return fmt.Sprintf("%d MiB", n>>20)
	case n >= 10<<10:
		return fmt.Sprintf("%d KiB", n>>10)
	}
	return fmt.Sprintf("%d bytes", n)
}

// textWidth is a generous estimate of a text's width in a sans-serif font of size px: enough to keep it
// inside the picture without measuring glyphs.
func textWidth(s string, px float64) float64 {
	return float64(utf8.RuneCountInString(s)) * px * 0.62
}

// text writes one <text> element with escaped content.
func text(b *bytes.Buffer, x, y float64, attrs, s string) {
	if attrs != "" {
		attrs = " " + attrs
	}
	fmt.Fprintf(b, `<text x="%s" y="%s"%s>%s</text>`+"\n", num(x), num(y), attrs, esc(s))
}

// num formats a coordinate with at most two decimals, the same on every run.
func num(v float64) string {
	return strconv.FormatFloat(math.Round(v*100)/100, 'f', -1, 64)
}

func fmtSecs(s float64) string {
	return strconv.FormatFloat(math.Round(s*1000)/1000, 'f', -1, 64)
}

func fmtDur(s float64) string {
	// A float beyond time.Duration's range converts to whatever the platform gives (the minimum on amd64:
	// a peer's absurd stage read as -2562047h).
	var d time.Duration
	switch ns := s * float64(time.Second); {
	case ns >= 0x1p63:
		d = math.MaxInt64
	case ns <= -0x1p63:
		d = math.MinInt64
	default:
		d = time.Duration(ns)
	}
	switch {
	case d == 0:
		return "0 s"
	case d < time.Millisecond:
		return d.Round(time.Microsecond).String()
	case d < time.Minute:
		return strconv.FormatFloat(s, 'f', 3, 64) + " s"
	}
	return d.Round(time.Second).String()
}

// esc makes s safe as XML character data and attribute values: markup characters and quotes are
// escaped, and characters XML cannot hold (controls, invalid UTF-8) become U+FFFD.
func esc(s string) string {
	var b strings.Builder
	_ = xml.EscapeText(&b, []byte(s)) // a strings.Builder does not fail
	return b.String()
}

// clip cuts s to at most n characters, marking the cut; invalid UTF-8 counts a byte as a character.
func clip(s string, n int) string {
	if utf8.RuneCountInString(s) <= n {
		return s
	}
	i := 0
	for k := 0; k < n-1; k++ {
		_, size := utf8.DecodeRuneInString(s[i:])
		i += size
	}
	return s[:i] + "…"
}
