package timelinesvg

import (
	"bytes"
	"encoding/xml"
	"errors"
	"io"
	"math"
	"strconv"
	"strings"
	"testing"
	"time"
)

var t0 = time.Date(2026, 11, 23, 12, 0, 0, 0, time.UTC)

func at(sec float64) time.Time { return t0.Add(time.Duration(sec * float64(time.Second))) }

// x is where sec lands on an axis of [lo, hi] seconds.
func x(lo, hi, sec float64) float64 { return barX + (sec-lo)/(hi-lo)*barW }

func TestLayout(t *testing.T) {
	type want struct{ x, w, secs float64 }
	tests := []struct {
		name     string
		f        Failure
		min, max float64
		bars     []want
	}{{
		name: "detection before the origin, then two stages",
		f: Failure{Origin: t0, Stages: []Stage{
			{Name: "detected", Start: at(-2), End: at(0)},
			{Name: "snapshot fetched", Start: at(0), End: at(1)},
			{Name: "restored", Start: at(1), End: at(3)},
		}},
		min: -2, max: 3,
		bars: []want{{x(-2, 3, -2), x(-2, 3, 0) - x(-2, 3, -2), 2}, {x(-2, 3, 0), x(-2, 3, 1) - x(-2, 3, 0), 1}, {x(-2, 3, 1), x(-2, 3, 3) - x(-2, 3, 1), 2}},
	}, {
		name: "the axis ends on a round tick",
		f:    Failure{Origin: t0, Stages: []Stage{{Name: "restored", Start: at(0.2), End: at(7.3)}}},
		min:  0, max: 8,
		bars: []want{{x(0, 8, 0.2), x(0, 8, 7.3) - x(0, 8, 0.2), 7.1}},
	}, {
		name: "the start is the earliest stage's, not a tick",
		f: Failure{Origin: t0, Stages: []Stage{
			{Name: "detected", Start: at(-2.013), End: at(0)},
			{Name: "re-protected", Start: at(9.8), End: at(10.657)},
		}},
		min: -2.013, max: 12,
		bars: []want{{barX, x(-2.013, 12, 0) - barX, 2.013}, {x(-2.013, 12, 9.8), x(-2.013, 12, 10.657) - x(-2.013, 12, 9.8), 0.857}},
	}, {
		name: "an instant stage is still visible",
		f: Failure{Origin: t0, Stages: []Stage{
			{Name: "spare claimed", Start: at(1), End: at(1)},
			{Name: "restored", Start: at(1), End: at(2)},
		}},
		min: 0, max: 2,
		bars: []want{{x(0, 2, 1), minBarW, 0}, {x(0, 2, 1), x(0, 2, 2) - x(0, 2, 1), 1}},
	}, {
		name: "an ongoing stage ends at Now",
		f: Failure{Origin: t0, Now: at(4), Stages: []Stage{
			{Name: "snapshot fetched", Start: at(0), End: at(1)},
			{Name: "restored", Start: at(1)},
		}},
		min: 0, max: 4,
		bars: []want{{x(0, 4, 0), x(0, 4, 1) - x(0, 4, 0), 1}, {x(0, 4, 1), x(0, 4, 4) - x(0, 4, 1), 3}},
	}, {
		name: "without Now an ongoing stage ends at the latest time shown",
		f: Failure{Origin: t0, Stages: []Stage{
			{Name: "snapshot fetched", Start: at(0), End: at(2)},
			{Name: "restored", Start: at(1), End: at(0.5)}, // an end before the start: under way
		}},
		min: 0, max: 2,
		bars: []want{{x(0, 2, 0), x(0, 2, 2) - x(0, 2, 0), 2}, {x(0, 2, 1), x(0, 2, 2) - x(0, 2, 1), 1}},
	}, {
		name: "no origin: the earliest start",
		f:    Failure{Stages: []Stage{{Name: "detected", Start: at(10), End: at(11)}}},
		min:  0, max: 1,
		bars: []want{{barX, barW, 1}},
	}, {
		name: "no stages: a one-second axis",
		f:    Failure{Origin: t0},
		min:  0, max: 1,
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ax, bars := layout(&tt.f)
			if !near(ax.Min, tt.min) || !near(ax.Max, tt.max) {
				t.Errorf("axis [%g, %g], want [%g, %g]", ax.Min, ax.Max, tt.min, tt.max)
			}
			if len(bars) != len(tt.bars) {
				t.Fatalf("%d bars, want %d", len(bars), len(tt.bars))
			}
			for i, b := range bars {
				w := tt.bars[i]
				if !near(b.X, w.x) || !near(b.W, w.w) || !near(b.Secs, w.secs) {
					t.Errorf("bar %d (%s): x %g width %g secs %g, want x %g width %g secs %g", i, tt.f.Stages[i].Name, b.X, b.W, b.Secs, w.x, w.w, w.secs)
				}
				if b.X < barX-1e-9 || b.X+b.W > barX+barW+minBarW {
					t.Errorf("bar %d (%s) at [%g, %g] leaves the axis [%d, %d]", i, tt.f.Stages[i].Name, b.X, b.X+b.W, barX, barX+barW)
				}
			}
		})
	}
}

func near(a, b float64) bool { return math.Abs(a-b) < 1e-6 }

func TestTicks(t *testing.T) {
	tests := []struct {
		ax   axis
		want []float64
	}{
		{axis{0, 1}, []float64{0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1}},
		{axis{-2, 3}, []float64{-2, -1.5, -1, -0.5, 0, 0.5, 1, 1.5, 2, 2.5, 3}},
		{axis{0, 8}, []float64{0, 1, 2, 3, 4, 5, 6, 7, 8}},
		{axis{0, 40}, []float64{0, 5, 10, 15, 20, 25, 30, 35, 40}},
		{axis{-20, 100}, []float64{-20, 0, 20, 40, 60, 80, 100}},
		{axis{-2.013, 12}, []float64{-2, 0, 2, 4, 6, 8, 10, 12}}, // the start need not be a tick
	}
	for _, tt := range tests {
		got := ticks(tt.ax)
		if len(got) != len(tt.want) {
			t.Errorf("ticks(%v) = %v, want %v", tt.ax, got, tt.want)
			continue
		}
		for i := range got {
			if !near(got[i], tt.want[i]) {
				t.Errorf("ticks(%v) = %v, want %v", tt.ax, got, tt.want)
				break
			}
		}
	}
}

// wellFormed fails the test unless svg is one well-formed XML document.
func wellFormed(t testing.TB, svg []byte) {
	t.Helper()
	d := xml.NewDecoder(bytes.NewReader(svg))
	d.Strict = true
	for {
		_, err := d.Token()
		if errors.Is(err, io.EOF) {
			return
		}
		if err != nil {
			t.Fatalf("the SVG is not well-formed XML: %v\n%s", err, svg)
		}
	}
}

// texts is the character data of every <text> and <title> element.
func texts(t testing.TB, svg []byte) []string {
	t.Helper()
	d := xml.NewDecoder(bytes.NewReader(svg))
	var out []string
	var in bool
	for {
		tok, err := d.Token()
		if errors.Is(err, io.EOF) {
			return out
		}
		if err != nil {
			t.Fatal(err)
		}
		switch tok := tok.(type) {
		case xml.StartElement:
			if tok.Name.Local == "script" || tok.Name.Local == "foreignObject" || tok.Name.Local == "style" {
				t.Errorf("element <%s> in the output", tok.Name.Local)
			}
			for _, a := range tok.Attr {
				if strings.HasPrefix(a.Name.Local, "on") || a.Name.Local == "href" {
					t.Errorf("attribute %s=%q on <%s>", a.Name.Local, a.Value, tok.Name.Local)
				}
			}
			in = tok.Name.Local == "text" || tok.Name.Local == "title"
			if in {
				out = append(out, "")
			}
		case xml.CharData:
			if in {
				out[len(out)-1] += string(tok)
			}
		case xml.EndElement:
			in = false
		}
	}
}

func TestHostileText(t *testing.T) {
	hostile := []string{
		`<script>alert(1)</script>`,
		`"/><image href="http://example.invalid/x.png"/><text x="`,
		`]]><!ENTITY x "y"> &amp; &lt;`,
		"a\x00b\x1bc\ufffe",
		"\xff\xfe invalid utf-8",
		strings.Repeat("é", 5000),
	}
	for _, h := range hostile {
		f := Failure{ID: h, Node: h, Detector: h, Target: h, Jobs: []string{h, h}, Error: h, Origin: t0,
			Stages: []Stage{{Name: h, Job: h, Host: h, Start: at(0), End: at(1), Detail: h, Error: h}}}
		svg := Render([]Failure{f})
		wellFormed(t, svg)
		for _, s := range texts(t, svg) {
			if n := len([]rune(s)); n > 2*textMax+40 {
				t.Errorf("a text of %d characters: not clipped", n)
			}
		}
		if bytes.Contains(svg, []byte("<script")) || bytes.Contains(svg, []byte("<image")) || bytes.Contains(svg, []byte("<!ENTITY")) {
			t.Errorf("hostile markup %q reached the output unescaped", h)
		}
	}
}

func TestClip(t *testing.T) {
	tests := []struct {
		in   string
		n    int
		want string
	}{
		{"short", 10, "short"},
		{"exactly10!", 10, "exactly10!"},
		{"eleven long", 10, "eleven lo…"},
		{"ééééé", 3, "éé…"},
		{"", 3, ""},
	}
	for _, tt := range tests {
		if got := clip(tt.in, tt.n); got != tt.want {
			t.Errorf("clip(%q, %d) = %q, want %q", tt.in, tt.n, got, tt.want)
		}
	}
}

// demoFailure is a recovery as the agent records it.
func demoFailure() Failure {
	return Failure{
		ID: "node2-20261123T120000.000", Outcome: Recovered, Node: "node2", Detector: "node3", Target: "spare1",
		Jobs: []string{"ft-rank1"}, Origin: t0,
		Stages: []Stage{
			{Name: "detected", Host: "node3", Start: at(-1.2), End: at(0), Detail: "no heartbeat for 1.2s; direct probe and the other neighbour confirmed"},
			{Name: "spare claimed", Host: "node3", Start: at(0), End: at(0.05), Detail: "1 job(s), 12 MB"},
			{Name: "snapshot fetched", Job: "ft-rank1", Host: "spare1", Start: at(0.06), End: at(0.9), Detail: "12 MB from node3 (snapshot s1, incarnation 2)"},
			{Name: "images rewritten", Job: "ft-rank1", Host: "spare1", Start: at(0.9), End: at(1.3), Detail: "2 connection(s): 786432 bytes injected, 65536 bytes to re-send, initcwnd 10"},
			{Name: "restored", Job: "ft-rank1", Host: "spare1", Start: at(1.3), End: at(2.1)},
			{Name: "replay done", Job: "ft-rank1", Host: "spare1", Start: at(2.1), End: at(2.4), Detail: "65536 bytes re-sent and discarded by the peers; 3 peer ACKs clamped; re-sent bytes verified: all 65536 on 2 connection(s)"},
			{Name: "re-protected", Host: "spare1", Start: at(2.4), End: at(3.4), Detail: "snapshot s2 shipped to node3"},
		},
	}
}

func TestRender(t *testing.T) {
	ongoing := demoFailure()
	ongoing.ID, ongoing.Outcome = "node4-x", Recovering
	ongoing.Stages = append(ongoing.Stages[:5:5], Stage{Name: "replay done", Job: "ft-rank3", Host: "spare1", Start: at(2.1)})
	failed := demoFailure()
	failed.ID, failed.Outcome, failed.Error, failed.StagesDropped = "node1-y", NotRecovered, "job ft-rank0: diverged", 4
	failed.Stages[5].Error = "connection 10.0.0.1:7 -> 10.0.0.2:9: diverged"
	svg := Render([]Failure{demoFailure(), ongoing, failed})
	wellFormed(t, svg)
	if again := Render([]Failure{demoFailure(), ongoing, failed}); !bytes.Equal(svg, again) {
		t.Error("two renderings of the same failures differ")
	}
	all := strings.Join(texts(t, svg), "\n")
	for _, want := range []string{
		"failure node2-20261123T120000.000", "recovered", "recovering", "NOT RECOVERED",
		"failed node node2 · detected by node3 · restored on spare spare1",
		"snapshot fetched · ft-rank1", "0.840 s", "1.200 s",
		"bytes replayed from the peers' logs: 768 KiB · re-sent by the job: 64 KiB · verified: 64 KiB on 2 connection(s)",
		"so far (under way)", "error: job ft-rank0: diverged", "error: connection 10.0.0.1:7 -> 10.0.0.2:9: diverged",
		"4 stage(s) between the first and the newest are not shown",
		"-1 s", "0 s", "3.5 s",
	} {
		if !strings.Contains(all, want) {
			t.Errorf("the picture does not say %q; it says:\n%s", want, all)
		}
	}
	if !bytes.Contains(svg, []byte(`fill="`+ErrorColour+`"`)) {
		t.Error("the failed stage is not drawn in the error colour")
	}
	if empty := Render(nil); !bytes.Contains(empty, []byte("no failures")) {
		t.Errorf("an empty log renders as %s", empty)
	}
}

func TestParseDetail(t *testing.T) {
	tests := []struct {
		detail string
		want   Bytes
	}{
		{"2 connection(s): 1234 bytes injected, 567 bytes to re-send, initcwnd 10", Bytes{Injected: 1234, HasInjected: true}},
		{"567 bytes re-sent and discarded by the peers; 3 peer ACKs clamped; re-sent bytes verified: all 567 on 2 connection(s)",
			Bytes{Resent: 567, HasResent: true, Verified: 567, Conns: 2, HasVerified: true}},
		{"re-sent bytes checked: 12, then connection a failed the check", Bytes{}},
		{"12 MB from node3 (snapshot s1, incarnation 2)", Bytes{}},
		{"99999999999999999999 bytes injected", Bytes{}},             // does not fit
		{"1125899906842625 bytes injected", Bytes{}},                 // above maxCount
		{"-5 bytes injected", Bytes{Injected: 5, HasInjected: true}}, // the sign is not part of the number
		{"", Bytes{}},
	}
	for _, tt := range tests {
		if got := ParseDetail(tt.detail); got != tt.want {
			t.Errorf("ParseDetail(%q) = %+v, want %+v", tt.detail, got, tt.want)
		}
	}
}

// FuzzParseDetail: details come from other nodes; no input may make the counts negative or unbounded.
func FuzzParseDetail(f *testing.F) {
	f.Add("2 connection(s): 1234 bytes injected, 567 bytes to re-send, initcwnd 10")
	f.Add("567 bytes re-sent and discarded by the peers; re-sent bytes verified: all 567 on 2 connection(s)")
	f.Add("9223372036854775807 bytes injected")
	f.Fuzz(func(t *testing.T, detail string) {
		b := ParseDetail(detail)
		for _, n := range []int64{b.Injected, b.Resent, b.Verified, b.Conns} {
			if n < 0 || n > maxCount {
				t.Fatalf("ParseDetail(%q) = %+v: a count out of [0, %d]", detail, b, maxCount)
			}
		}
		s := b
		for range 64 {
			s = s.Add(b)
		}
		if s.Injected < 0 || s.Resent < 0 || s.Verified < 0 || s.Conns < 0 {
			t.Fatalf("sums overflowed: %+v", s)
		}
	})
}

// FuzzRender: whatever text and times a peer sends, the picture is one well-formed SVG document.
func FuzzRender(f *testing.F) {
	f.Add("node2-x", "detected", "no heartbeat for 1s", "<b>&amp;", int64(0), int64(1e9))
	f.Add("]]>", "\x00", "\xff", `"'`, int64(-1<<62), int64(1<<62))
	f.Add("", "", "", "", int64(5), int64(-5))
	f.Fuzz(func(t *testing.T, id, name, detail, errText string, start, end int64) {
		fl := Failure{ID: id, Node: name, Detector: detail, Target: errText, Error: errText, Jobs: []string{name}, Origin: t0,
			Stages: []Stage{
				{Name: name, Job: id, Host: detail, Start: t0.Add(time.Duration(start)), End: t0.Add(time.Duration(end)), Detail: detail, Error: errText},
				{Name: "restored", Start: t0, End: t0.Add(time.Duration(end))},
			}}
		svg := Render([]Failure{fl})
		wellFormed(t, svg)
		finiteCoordinates(t, svg)
	})
}

// finiteCoordinates fails t if a coordinate or size attribute is not a finite number (the text may say
// NaN: a peer's error text is shown as it came).
func finiteCoordinates(t testing.TB, svg []byte) {
	t.Helper()
	d := xml.NewDecoder(bytes.NewReader(svg))
	for {
		tok, err := d.Token()
		if errors.Is(err, io.EOF) {
			return
		}
		if err != nil {
			t.Fatal(err)
		}
		el, ok := tok.(xml.StartElement)
		if !ok {
			continue
		}
		for _, a := range el.Attr {
			switch a.Name.Local {
			case "x", "y", "x1", "y1", "x2", "y2", "width", "height":
				if v, err := strconv.ParseFloat(a.Value, 64); err != nil || math.IsNaN(v) || math.IsInf(v, 0) {
					t.Fatalf("<%s %s=%q>: not a finite number:\n%s", el.Name.Local, a.Name.Local, a.Value, svg)
				}
			}
		}
	}
}

// A stage longer than time.Duration's range is labelled with the longest duration, not a negative one
// (the fuzzer's stage from -2^62 to 2^62 ns was labelled -2562047h47m16.854775808s).
func TestFmtDurBeyondRange(t *testing.T) {
	for _, s := range []float64{1e10, 9.3e9, math.MaxFloat64} {
		if got := fmtDur(s); strings.HasPrefix(got, "-") {
			t.Errorf("fmtDur(%g) = %q: negative", s, got)
		}
	}
	if got := fmtDur(-1e10); !strings.HasPrefix(got, "-") {
		t.Errorf("fmtDur(-1e10) = %q: not negative", got)
	}
	if got := fmtDur(1.5); got != "1.500 s" {
		t.Errorf("fmtDur(1.5) = %q, want 1.500 s", got)
	}
}

// Every stage the agent records has a colour of its own: a grey bar would read as "other".
func TestStageColours(t *testing.T) {
	seen := map[string]string{}
	for _, name := range []string{"detected", "spare claimed", "fenced", "self-fenced", "snapshot fetched",
		"images rewritten", "restored", "replay done", "re-protected"} {
		c := Colour(Stage{Name: name})
		if c == Colour(Stage{Name: "something else"}) || c == ErrorColour {
			t.Errorf("stage %q is drawn in %s, the colour of unknown stages or of errors", name, c)
		}
		if other, dup := seen[c]; dup {
			t.Errorf("stages %q and %q share colour %s", name, other, c)
		}
		seen[c] = name
	}
}
