package controller

import (
	"reflect"
	"testing"
	"time"
)

var t0 = time.Date(2026, 11, 22, 12, 0, 0, 0, time.UTC)

func at(s float64) time.Time { return t0.Add(time.Duration(s * float64(time.Second))) }

func TestConfigValidation(t *testing.T) {
	for _, cfg := range []Config{{}, {Cap: 100, High: 0.5, Low: 0.6}, {Cap: 100, High: 1.2}, {Cap: -1}} {
		if _, err := New(cfg); err == nil {
			t.Errorf("New(%+v) accepted an invalid configuration", cfg)
		}
	}
	c, err := New(Config{Cap: 1000})
	if err != nil || c.Config().High != 0.8 || c.Config().Low != 0.6 || c.Config().Cooldown != 30*time.Second || c.Config().PausedRetry != 2*time.Second {
		t.Fatalf("defaults: %+v, %v", c.Config(), err)
	}
}

// A sequence of measurements and the actions and events each must produce. Cap 1000: high 800, low 600.
func TestStepSequence(t *testing.T) {
	dests := []Destination{
		{Node: "node3", Bytes: 150, Oldest: at(-5)},
		{Node: "node2", Bytes: 300, Oldest: at(-20)}, // oldest first
		{Node: "node4", Bytes: 400, Oldest: at(-1)},
	}
	steps := []struct {
		name   string
		state  State
		action Action
		events []EventKind
	}{
		{name: "below high: nothing", state: State{Now: at(0), Memory: 700, Destinations: dests, CanSpill: true},
			action: Action{}},
		{name: "crossing high: oldest destinations until the excess over low is covered",
			state:  State{Now: at(1), Memory: 850, Destinations: dests, CanSpill: true},
			action: Action{RequestSnapshots: []string{"node2"}}, // 300 >= 850-600=250
			events: []EventKind{EventHigh, EventRequest}},
		{name: "still high within cooldown: node2's pending snapshot covers the excess, no spill yet",
			state:  State{Now: at(5), Memory: 900, Destinations: dests, CanSpill: true},
			action: Action{}}, // need 300, node2 (already asked) holds 300
		{name: "at the cap: pause, ask node2 again (paused, its request stood past PausedRetry) and the next oldest, and spill after the grace period",
			state:  State{Now: at(12), Memory: 1000, Destinations: dests, CanSpill: true},
			action: Action{RequestSnapshots: []string{"node2", "node3"}, SpillBytes: 400, Pause: true}, // need 400: node2 300 + node3 150
			events: []EventKind{EventPause, EventRequest, EventRequest, EventSpill}},
		{name: "between high and cap: still paused (hysteresis)",
			state:  State{Now: at(13), Memory: 850, Destinations: dests, CanSpill: false},
			action: Action{Pause: true}},
		{name: "below high: resume; not yet below low",
			state:  State{Now: at(14), Memory: 700, Destinations: dests},
			action: Action{}, events: []EventKind{EventResume}},
		{name: "below low: relieved",
			state:  State{Now: at(15), Memory: 500},
			action: Action{}, events: []EventKind{EventRelieved}},
		{name: "high again after the cooldown: node2 asked again",
			state:  State{Now: at(43), Memory: 820, Destinations: dests},
			action: Action{RequestSnapshots: []string{"node2"}},
			events: []EventKind{EventHigh, EventRequest}},
	}
	c, err := New(Config{Cap: 1000})
	if err != nil {
		t.Fatal(err)
	}
	for _, st := range steps {
		a, ev := c.Step(st.state)
		var kinds []EventKind
		for _, e := range ev {
			kinds = append(kinds, e.Kind)
			if e.Memory != st.state.Memory || !e.Time.Equal(st.state.Now) {
				t.Errorf("%s: event %+v does not carry the measurement", st.name, e)
			}
		}
		if !reflect.DeepEqual(a, st.action) || !reflect.DeepEqual(kinds, st.events) {
			t.Errorf("%s:\n got %+v %v\nwant %+v %v", st.name, a, kinds, st.action, st.events)
		}
	}
}

// Whatever the measurements, the controller pauses at the cap and never asks for a spill it cannot do.
func TestInvariants(t *testing.T) {
	c, _ := New(Config{Cap: 1 << 20, SpillGrace: time.Second})
	dests := []Destination{{Node: "a", Bytes: 1 << 19, Oldest: t0}, {Node: "b", Bytes: 1 << 19, Oldest: t0.Add(time.Second)}}
	for i := 0; i < 1000; i++ {
		mem := int64((i * 7919) % (3 << 19))
		canSpill := i%3 == 0
		a, _ := c.Step(State{Now: at(float64(i) / 10), Memory: mem, Destinations: dests, CanSpill: canSpill})
		if mem >= 1<<20 && !a.Pause {
			t.Fatalf("step %d: memory %d at the cap but not paused", i, mem)
		}
		if a.SpillBytes != 0 && (!canSpill || a.SpillBytes > mem) {
			t.Fatalf("step %d: spill %d with canSpill=%v memory %d", i, a.SpillBytes, canSpill, mem)
		}
	}
}

func TestRelievedEndsCooldown(t *testing.T) {
	c, _ := New(Config{Cap: 1000})
	dests := []Destination{{Node: "node2", Bytes: 500, Oldest: t0}}
	if a, _ := c.Step(State{Now: at(0), Memory: 900, Destinations: dests}); len(a.RequestSnapshots) != 1 {
		t.Fatalf("first request: %+v", a)
	}
	if a, _ := c.Step(State{Now: at(1), Memory: 900, Destinations: dests}); len(a.RequestSnapshots) != 0 {
		t.Fatalf("repeated within the cooldown: %+v", a)
	}
	c.Relieved("node2")
	if a, _ := c.Step(State{Now: at(2), Memory: 900, Destinations: dests}); len(a.RequestSnapshots) != 1 {
		t.Fatalf("not asked again after its snapshot trimmed the log: %+v", a)
	}
}

// TestPausedRetry: at the cap, with the jobs' segments held back, an unanswered request is repeated after
// PausedRetry rather than the cooldown (a lost request left a log paused until TCP gave up: ci258); back
// under the cap, the cooldown applies again.
func TestPausedRetry(t *testing.T) {
	c, _ := New(Config{Cap: 1000})
	dests := []Destination{{Node: "node2", Bytes: 500, Oldest: t0}}
	for _, st := range []struct {
		at     float64
		memory int64
		ask    bool
	}{
		{0, 900, true},    // above High: asked
		{1, 1000, false},  // paused, within PausedRetry of the request
		{2.5, 1000, true}, // paused, PausedRetry passed: asked again
		{3, 1000, false},
		{5, 950, true},  // still paused (it resumes only under High), PausedRetry passed
		{6, 700, false}, // resumed, under High: nothing to ask
		{7, 850, false}, // above High again, not paused: the cooldown from the request at 5 s
		{20, 850, false},
		{35.1, 850, true},
	} {
		a, _ := c.Step(State{Now: at(st.at), Memory: st.memory, Destinations: dests})
		if asked := len(a.RequestSnapshots) == 1; asked != st.ask {
			t.Errorf("at %vs, memory %d (paused %v): asked %v, want %v", st.at, st.memory, a.Pause, asked, st.ask)
		}
	}
}

// TestSpillGraceAfterDip: the spill grace counts from when memory last rose above High. A log that dipped
// between the watermarks (its receivers' snapshots trimmed it there, not below Low) and rose above High an
// hour later is given the grace again before it spills: its receivers are asked first. Before, the
// pressure's start stayed at the first crossing, and the step that asked for snapshots spilled too.
func TestSpillGraceAfterDip(t *testing.T) {
	c, _ := New(Config{Cap: 1000})
	dests := []Destination{{Node: "node2", Bytes: 500, Oldest: t0}}
	for _, st := range []struct {
		at     float64
		memory int64
		spill  bool
	}{
		{0, 850, false},    // above High: asked, no spill yet
		{5, 700, false},    // the snapshot trimmed the log between the watermarks
		{3600, 700, false}, // an hour there: a log's ordinary level
		{3601, 850, false}, // above High again: ask first
		{3605, 850, false},
		{3611, 850, true}, // still high after the grace: spill
	} {
		a, _ := c.Step(State{Now: at(st.at), Memory: st.memory, Destinations: dests, CanSpill: true})
		if spilled := a.SpillBytes > 0; spilled != st.spill {
			t.Errorf("at %vs, memory %d: spill %d (asked %v), want spill %v", st.at, st.memory, a.SpillBytes, a.RequestSnapshots, st.spill)
		}
	}
}
