/* The splits of byte-level BPE pre-tokenizers (bpe_tokenize.c), each regex of kvserve/pretokenizers.py
 * written out by hand over the character classes of unicode_classes.h: a match at a position, in code
 * points, as the regex engine's leftmost, first-alternative, backtracking match would be. */
#ifndef KVSERVE_BPE_SPLITS_H
#define KVSERVE_BPE_SPLITS_H

#include <stdint.h>

#include "kernels.h"
#include "unicode_classes.h"

/* One plain segment as code points, their classes and byte offsets (at[n] = its length in bytes). */
typedef struct {
    const char *text;
    uint32_t *cp;
    uint8_t *bits;
    int64_t *at;
    int64_t n;
} Segment;

#define HAS(i, classes) (t->bits[i] & (classes))
#define IS_NEWLINE(i) (t->cp[i] == '\r' || t->cp[i] == '\n')

static int64_t run_of(const Segment *t, int64_t i, int64_t end, uint8_t classes) {
    int64_t k = i;
    while (k < end && HAS(k, classes)) k++;
    return k - i;
}

static int64_t run_not(const Segment *t, int64_t i, int64_t end, uint8_t classes) {
    int64_t k = i;
    while (k < end && !HAS(k, classes)) k++;
    return k - i;
}

/* 's|'t|'re|'ve|'m|'ll|'d at i; `fold`: case-insensitive, as (?i:...) matches (ſ folds to s). */
static int64_t contraction(const Segment *t, int64_t i, int64_t end, int fold) {
    if (t->cp[i] != '\'' || i + 1 >= end) return 0;
    uint32_t a = t->cp[i + 1], b = i + 2 < end ? t->cp[i + 2] : 0;
    if (fold) {
        a = a == 0x17F ? 's' : (a >= 'A' && a <= 'Z') ? a + 32 : a;
        b = (b >= 'A' && b <= 'Z') ? b + 32 : b;
    }
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
    if (((a == 'r' || a == 'v') && b == 'e') || (a == 'l' && b == 'l')) return 3;
    return 0;
}

/* \s+(?!\S)|\s+ at i: a run of white space, less its last character where a non-space follows and the run
 * is longer than one (that character goes with the word after it). */
static int64_t spaces(const Segment *t, int64_t i, int64_t end) {
    int64_t k = run_of(t, i, end, UC_SPACE);
    return (i + k < end && k > 1) ? k - 1 : k;
}

/*  ?[^\s\p{L}\p{N}]+[\r\n]* (with '/' among the characters after the symbols where `slash`), else
 * \s*[\r\n]+|\s+(?!\S)|\s+: Llama 3's and GPT-4o's alternatives after their words and numbers. */
static int64_t symbols_or_spaces(const Segment *t, int64_t i, int64_t end, int slash) {
    int64_t j = i + (t->cp[i] == ' ' && i + 1 < end);
    if (!HAS(j, UC_SPACE | UC_L | UC_N)) {
        int64_t k = j + run_not(t, j, end, UC_SPACE | UC_L | UC_N);
        while (k < end && (IS_NEWLINE(k) || (slash && t->cp[k] == '/'))) k++;
        return k - i;
    }
    int64_t k = i, last_newline = -1; /* \s*[\r\n]+: through the run's last line break */
    for (; k < end && HAS(k, UC_SPACE); k++)
        if (IS_NEWLINE(k)) last_newline = k;
    if (last_newline >= 0) return last_newline + 1 - i;
    return spaces(t, i, end);
}

/* 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+ */
static int64_t match_gpt2(const Segment *t, int64_t i, int64_t end) {
    int64_t m = contraction(t, i, end, 0);
    if (m) return m;
    int64_t j = i + (t->cp[i] == ' ' && i + 1 < end); /* a space never is L, N or a symbol: one of the two */
    if (HAS(j, UC_L)) return j - i + run_of(t, j, end, UC_L);
    if (HAS(j, UC_N)) return j - i + run_of(t, j, end, UC_N);
    if (!HAS(j, UC_SPACE | UC_L | UC_N)) return j - i + run_not(t, j, end, UC_SPACE | UC_L | UC_N);
    return spaces(t, i, end);
}

/* (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,digits}| ?[^\s\p{L}\p{N}]+[\r\n]*|
 * \s*[\r\n]+|\s+(?!\S)|\s+  (Llama 3's, with digits 3; Qwen2's, with digits 1) */
static int64_t match_llama3(const Segment *t, int64_t i, int64_t end, int64_t digits) {
    int64_t m = contraction(t, i, end, 1);
    if (m) return m;
    if (HAS(i, UC_L)) return run_of(t, i, end, UC_L);
    if (!IS_NEWLINE(i) && !HAS(i, UC_N) && i + 1 < end && HAS(i + 1, UC_L)) return 1 + run_of(t, i + 1, end, UC_L);
    if (HAS(i, UC_N)) {
        m = run_of(t, i, end, UC_N);
        return m < digits ? m : digits;
    }
    return symbols_or_spaces(t, i, end, 0);
}

/* GPT-4o's word classes: [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}] ("upper"), [\p{Ll}\p{Lm}\p{Lo}\p{M}] ("lower"), and
 * the optional character before a word, [^\r\n\p{L}\p{N}]. */
#define IS_UPPERISH(k) (HAS(k, UC_M) || (HAS(k, UC_L) && !HAS(k, UC_LOWER)))
#define IS_LOWERISH(k) (HAS(k, UC_M) || (HAS(k, UC_L) && !HAS(k, UC_UPPER)))
#define IS_BEFORE_WORD(k) (!IS_NEWLINE(k) && !HAS(k, UC_L | UC_N))

/* [upper]*[lower]+ at s: the upper run backs off until a lower character follows it (the backtracking
 * of the greedy star); 0 for no match. */
static int64_t upper_then_lower(const Segment *t, int64_t s, int64_t end) {
    int64_t u = 0;
    while (s + u < end && IS_UPPERISH(s + u)) u++;
    for (int64_t j = u; j >= 0; j--) {
        if (s + j < end && IS_LOWERISH(s + j)) {
            int64_t k = s + j;
            while (k < end && IS_LOWERISH(k)) k++;
            return k - s;
        }
    }
    return 0;
}

/* [upper]+[lower]* at s; 0 for no match. */
static int64_t upper_run_then_lower(const Segment *t, int64_t s, int64_t end) {
    int64_t k = s;
    while (k < end && IS_UPPERISH(k)) k++;
    if (k == s) return 0;
    while (k < end && IS_LOWERISH(k)) k++;
    return k - s;
}

/* A word of GPT-4o's split at i: [before]?<word>, the optional character taken first and given back where
 * the word then fails; its length with a contraction after it (`contractions`), or 0. */
static int64_t case_word(const Segment *t, int64_t i, int64_t end, int64_t (*word)(const Segment *, int64_t, int64_t),
                         int contractions) {
    int64_t m = 0;
    if (IS_BEFORE_WORD(i) && i + 1 < end && (m = word(t, i + 1, end)) > 0) m += 1;
    else m = word(t, i, end);
    if (m > 0 && contractions && i + m < end) m += contraction(t, i + m, end, 1);
    return m;
}

/* GPT-4o's (contractions, digits 3) and Mistral's tekken (neither contractions nor runs of digits):
 * [^\r\n\p{L}\p{N}]?[upper]*[lower]+(?i:'s|...)?|[^\r\n\p{L}\p{N}]?[upper]+[lower]*(?i:'s|...)?|\p{N}{1,3}|
 * ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+ */
static int64_t match_case_split(const Segment *t, int64_t i, int64_t end, int64_t digits, int contractions) {
    int64_t m = case_word(t, i, end, upper_then_lower, contractions);
    if (m) return m;
    m = case_word(t, i, end, upper_run_then_lower, contractions);
    if (m) return m;
    if (HAS(i, UC_N)) {
        m = run_of(t, i, end, UC_N);
        return m < digits ? m : digits;
    }
    return symbols_or_spaces(t, i, end, 1);
}

static int is_default_symbol(uint32_t c) {
    return c == '$' || c == '+' || c == '<' || c == '=' || c == '>' || c == '^' || c == '~' || c == '|';
}

/* The match of split `kind` at i within [i, end), in code points; 0 for none. */
static int64_t match(int kind, const Segment *t, int64_t i, int64_t end) {
    switch (kind) {
    case BPE_SPLIT_GPT2: return match_gpt2(t, i, end);
    case BPE_SPLIT_LLAMA3: return match_llama3(t, i, end, 3);
    case BPE_SPLIT_QWEN2: return match_llama3(t, i, end, 1);
    case BPE_SPLIT_GPT4O: return match_case_split(t, i, end, 3, 1);
    case BPE_SPLIT_TEKKEN: return match_case_split(t, i, end, 1, 0);
    case BPE_SPLIT_DIGIT: return HAS(i, UC_N) ? 1 : 0;
    case BPE_SPLIT_DIGITS: return run_of(t, i, end, UC_N);
    case BPE_SPLIT_PUNCTUATION: {  /* [\p{P}$+<=>^~|]+ */
        int64_t k = i;
        while (k < end && (HAS(k, UC_P) || is_default_symbol(t->cp[k]))) k++;
        return k - i;
    }
    case BPE_SPLIT_THREE_DIGITS: {  /* [0-9]{3} */
        int64_t k = i;
        while (k < end && k - i < 3 && t->cp[k] >= '0' && t->cp[k] <= '9') k++;
        return k - i == 3 ? 3 : 0;
    }
    default: return 0;
    }
}

#endif
